//! Turning text into search terms: lowercase words split on anything not a letter or digit
//! (so `restart_service` and `cert-expiry` split too), stop words dropped, English stems.

use rust_stemmers::{Algorithm, Stemmer};

/// Longest word kept whole; longer runs of letters are cut, so 4 KiB of one letter is one
/// short term, not a 4 KiB key in every map it passes through.
const MAX_WORD_CHARS: usize = 32;

/// Words that say nothing about which tool is wanted: English function words and the filler
/// of requests ("can you please show me"). Kept short on purpose: a verb such as `list` or
/// `check` does tell tools apart, and BM25's IDF already discounts words every tool has.
const STOP_WORDS: &[&str] = &[
    "a", "about", "after", "again", "all", "am", "an", "and", "any", "are", "as", "at", "be",
    "been", "before", "being", "but", "by", "can", "could", "did", "do", "does", "doing", "for",
    "from", "get", "give", "had", "has", "have", "having", "he", "her", "here", "him", "his",
    "how", "i", "if", "in", "into", "is", "it", "its", "just", "let", "like", "me", "might", "my",
    "need", "of", "on", "or", "our", "please", "she", "should", "so", "some", "than", "that",
    "the", "their", "them", "then", "there", "these", "they", "this", "those", "to", "too", "up",
    "us", "very", "want", "was", "we", "were", "what", "when", "where", "which", "while", "who",
    "whom", "why", "will", "with", "would", "you", "your",
];

/// Splits text into search terms. One per process is enough; it holds no state beyond the
/// stemmer's tables.
pub struct Analyzer {
    stemmer: Stemmer,
}

impl std::fmt::Debug for Analyzer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Analyzer(english)")
    }
}

impl Default for Analyzer {
    fn default() -> Self {
        Analyzer {
            stemmer: Stemmer::create(Algorithm::English),
        }
    }
}

impl Analyzer {
    /// The terms of `text`, in order, repeats kept (term frequency counts them).
    pub fn terms(&self, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        for word in words(text) {
            if STOP_WORDS.binary_search(&word.as_str()).is_ok() {
                continue;
            }
            out.push(self.stemmer.stem(&word).into_owned());
        }
        out
    }
}

/// Lowercase alphanumeric runs of `text`, each at most [`MAX_WORD_CHARS`] characters.
fn words(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(|w| {
            w.chars()
                .take(MAX_WORD_CHARS)
                .flat_map(char::to_lowercase)
                .collect()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_words_are_sorted_for_binary_search() {
        assert!(STOP_WORDS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn splits_names_stems_and_drops_stop_words() {
        let a = Analyzer::default();
        let cases: &[(&str, &[&str])] = &[
            ("restart_service", &["restart", "servic"]),
            ("cert-expiry", &["cert", "expiri"]),
            ("How hot is the CPU running?", &["hot", "cpu", "run"]),
            ("Disk usage of /var/log", &["disk", "usag", "var", "log"]),
            ("the of and", &[]),
            ("", &[]),
            ("\0\u{fffd}\u{200b}", &[]),
        ];
        for (text, want) in cases {
            assert_eq!(a.terms(text), *want, "{text:?}");
        }
    }

    #[test]
    fn long_words_are_cut() {
        let a = Analyzer::default();
        let terms = a.terms(&"x".repeat(4096));
        assert_eq!(terms.len(), 1);
        assert!(terms[0].chars().count() <= MAX_WORD_CHARS);
    }
}
