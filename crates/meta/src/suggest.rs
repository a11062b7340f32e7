//! "Did you mean …?": the known names closest to a mistyped one, for unknown tools and hosts.
//!
//! Every side that refuses an unknown name (the coordinator for hosts and tools, `toolctl local`
//! for tools) suggests with this, so the same typo gets the same suggestion everywhere.

/// Most names suggested at once.
const MAX_SUGGESTIONS: usize = 3;

/// The names of `known` closest to `wanted`, best first then by name: those within a few edits
/// (about one per three characters; a swap of two neighbours counts as one), or that `wanted`
/// begins (`disk` for `disk_usage`). Case is ignored. Empty when nothing is close.
pub fn closest<'a>(wanted: &str, known: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let wanted_lower: Vec<char> = wanted.to_lowercase().chars().collect();
    let limit = (wanted_lower.len() / 3).max(1);
    let mut scored: Vec<(usize, &str)> = known
        .into_iter()
        .filter(|k| *k != wanted)
        .filter_map(|k| {
            let lower: Vec<char> = k.to_lowercase().chars().collect();
            let distance = edit_distance(&wanted_lower, &lower);
            if distance <= limit {
                Some((distance, k))
            } else if wanted_lower.len() >= 3 && lower.starts_with(&wanted_lower) {
                Some((limit, k))
            } else {
                None
            }
        })
        .collect();
    scored.sort();
    scored.dedup();
    let Some(&(best, _)) = scored.first() else {
        return Vec::new();
    };
    scored
        .into_iter()
        .take_while(|(d, _)| *d == best)
        .take(MAX_SUGGESTIONS)
        .map(|(_, k)| k)
        .collect()
}

/// `; did you mean `x`?` (or `` `x` or `y` ``) for the names of `known` closest to `wanted`, to
/// append to a message about an unknown name; empty when nothing is close.
pub fn did_you_mean<'a>(wanted: &str, known: impl IntoIterator<Item = &'a str>) -> String {
    let names: Vec<String> = closest(wanted, known)
        .into_iter()
        .map(|n| format!("`{n}`"))
        .collect();
    match names.as_slice() {
        [] => String::new(),
        [one] => format!("; did you mean {one}?"),
        [init @ .., last] => format!("; did you mean {} or {last}?", init.join(", ")),
    }
}

/// Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
/// neighbouring characters each cost one.
fn edit_distance(a: &[char], b: &[char]) -> usize {
    let width = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * width];
    let at = |i: usize, j: usize| i * width + j;
    for i in 0..=a.len() {
        d[at(i, 0)] = i;
    }
    for j in 0..=b.len() {
        d[at(0, j)] = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[at(i - 1, j)] + 1)
                .min(d[at(i, j - 1)] + 1)
                .min(d[at(i - 1, j - 1)] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[at(i - 2, j - 2)] + 1);
            }
            d[at(i, j)] = best;
        }
    }
    d[at(a.len(), b.len())]
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOOLS: &[&str] = &[
        "checksum",
        "disk_usage",
        "env_info",
        "file_search",
        "gpu_status",
        "json_value",
    ];

    #[test]
    fn suggests_close_names_only() {
        let cases: &[(&str, &[&str])] = &[
            ("env_inf", &["env_info"]),
            ("Env_Info", &["env_info"]),
            ("evn_info", &["env_info"]),
            ("disk", &["disk_usage"]),
            ("chksum", &["checksum"]),
            ("nope", &[]),
            ("x", &[]),
            ("gpu", &["gpu_status"]),
            ("env_info", &[]),
        ];
        for (wanted, expected) in cases {
            assert_eq!(
                closest(wanted, TOOLS.iter().copied()),
                *expected,
                "{wanted}"
            );
        }
        assert_eq!(closest("lcoal", ["local", "web-1"]), ["local"]);
        assert_eq!(
            closest("web-9", ["web-1", "web-2", "db-1"]),
            ["web-1", "web-2"]
        );
    }

    #[test]
    fn wording() {
        assert_eq!(did_you_mean("lcoal", ["local"]), "; did you mean `local`?");
        assert_eq!(
            did_you_mean("web-9", ["web-1", "web-2", "web-3", "web-4"]),
            "; did you mean `web-1`, `web-2` or `web-3`?"
        );
        assert_eq!(did_you_mean("zzz", ["local"]), "");
    }

    #[test]
    fn distances() {
        let d = |a: &str, b: &str| {
            edit_distance(
                &a.chars().collect::<Vec<_>>(),
                &b.chars().collect::<Vec<_>>(),
            )
        };
        assert_eq!(d("", ""), 0);
        assert_eq!(d("abc", ""), 3);
        assert_eq!(d("lcoal", "local"), 1);
        assert_eq!(d("kitten", "sitting"), 3);
    }
}
