//! Globs compiled for selectors, which clients send: matching a text against all the
//! alternatives of a selector term costs time linear in the text, whatever the patterns.
//!
//! The shared matcher ([`toolsrv_confine::glob`]) backtracks to the last `*` and takes one
//! pattern at a time: a 4 KiB selector of `*aaa…ab` terms took 5.2 s over 10,000 hosts with
//! 245-character ids, and one of 400 short terms 3.2 s, on a coordinator thread holding the
//! fleet's lock (BENCHMARKS.md, "Selectors"); compiled, every shape takes about 0.4 s there. Here every position of every alternative is one bit,
//! and all of them advance together with each character of the text (a bit-parallel NFA, as in
//! Shift-And): a selector of `n` pattern characters costs `n / 64` word operations a character
//! of text, at most 65 for the 4 KiB a selector may have. The language is the same: `*` any run,
//! `?` any one character.

/// Alternatives compiled together: whether a text matches any of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Globs {
    /// 64-bit words of each set of positions.
    words: usize,
    /// Where each alternative starts.
    start: Vec<u64>,
    /// The position past each alternative's last character: reached, the text matches it. No
    /// character moves a bit on from there, so alternatives never run into one another.
    end: Vec<u64>,
    /// Positions holding `*` (a run of them counts as one).
    star: Vec<u64>,
    /// Positions holding `?`.
    any: Vec<u64>,
    /// Positions holding each literal character, sorted by character.
    literal: Vec<(char, Vec<u64>)>,
}

fn set(bits: &mut [u64], i: usize) {
    bits[i / 64] |= 1 << (i % 64);
}

/// `bits |= (bits & mask) << 1`, carried across words.
fn or_shifted(bits: &mut [u64], mask: &[u64]) {
    let mut carry = 0;
    for (word, m) in bits.iter_mut().zip(mask) {
        let moving = *word & m;
        *word |= (moving << 1) | carry;
        carry = moving >> 63;
    }
}

impl Globs {
    pub(crate) fn new<'a>(patterns: impl IntoIterator<Item = &'a str>) -> Self {
        let patterns: Vec<Vec<char>> = patterns
            .into_iter()
            .map(|p| {
                let mut chars: Vec<char> = p.chars().collect();
                chars.dedup_by(|a, b| *a == '*' && *b == '*');
                chars
            })
            .collect();
        let positions: usize = patterns.iter().map(|p| p.len() + 1).sum();
        let words = positions / 64 + 1;
        let mut globs = Self {
            words,
            start: vec![0; words],
            end: vec![0; words],
            star: vec![0; words],
            any: vec![0; words],
            literal: Vec::new(),
        };
        let mut at = 0;
        for chars in &patterns {
            set(&mut globs.start, at);
            for &c in chars {
                match c {
                    '*' => set(&mut globs.star, at),
                    '?' => set(&mut globs.any, at),
                    c => {
                        let i = match globs.literal.binary_search_by_key(&c, |(l, _)| *l) {
                            Ok(i) => i,
                            Err(i) => {
                                globs.literal.insert(i, (c, vec![0; words]));
                                i
                            }
                        };
                        set(&mut globs.literal[i].1, at);
                    }
                }
                at += 1;
            }
            set(&mut globs.end, at);
            at += 1;
        }
        globs
    }

    /// Whether the whole of `text` matches one of the alternatives.
    pub(crate) fn matches(&self, text: &str) -> bool {
        let mut active = self.start.clone();
        // A `*` may match nothing: the position after it is reached at once (runs of `*` are
        // one, so one step suffices).
        or_shifted(&mut active, &self.star);
        let mut next = vec![0u64; self.words];
        for c in text.chars() {
            let literal = self
                .literal
                .binary_search_by_key(&c, |(l, _)| *l)
                .ok()
                .map(|i| &self.literal[i].1);
            let mut carry = 0;
            let mut alive = 0;
            for w in 0..self.words {
                let takes = self.any[w] | literal.map_or(0, |l| l[w]);
                let advancing = active[w] & takes;
                next[w] = (advancing << 1) | carry | (active[w] & self.star[w]);
                carry = advancing >> 63;
                alive |= next[w];
            }
            if alive == 0 {
                return false;
            }
            or_shifted(&mut next, &self.star);
            std::mem::swap(&mut active, &mut next);
        }
        active.iter().zip(&self.end).any(|(a, e)| a & e != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random alternatives and texts over a small alphabet, long enough to span words, agree
    /// with the shared matcher (the cases written out are `selector`'s `globs`).
    #[test]
    fn it_agrees_with_the_shared_matcher() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..20_000 {
            let patterns: Vec<String> = (0..1 + next(4))
                .map(|_| {
                    (0..next(120))
                        .map(|_| ['a', 'b', '*', '?', 'a'][next(5) as usize])
                        .collect()
                })
                .collect();
            let t: String = (0..next(150))
                .map(|_| ['a', 'b'][next(2) as usize])
                .collect();
            let want = patterns.iter().any(|p| toolsrv_confine::glob(p, &t));
            let globs = Globs::new(patterns.iter().map(String::as_str));
            assert_eq!(globs.matches(&t), want, "{patterns:?} vs {t}");
        }
        // No alternatives: nothing matches.
        assert!(!Globs::new([]).matches(""));
    }
}
