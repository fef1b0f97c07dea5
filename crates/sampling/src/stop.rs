//! Stop strings that may span token boundaries, checked on the decoded text.

/// Where a stop string matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopMatch {
    /// Byte offset in the text where the stop string starts (the output ends there).
    pub start: usize,
    /// Byte offset just past the stop string (where the output ends when it is kept).
    pub end: usize,
    /// Which stop string matched.
    pub index: usize,
}

/// A set of stop strings. Feed it the whole decoded output so far: a stop string split across
/// tokens is found once its last piece arrives, and [`StopStrings::holdback`] tells a streamer how
/// much of the tail to keep back because it may be the start of a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    /// The non-empty strings, each with its index in the list given.
    strings: Vec<(usize, String)>,
}

impl StopStrings {
    /// Empty strings are ignored (a match's index still counts them: it is the string's place in
    /// `strings`).
    pub fn new(strings: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            strings: strings
                .into_iter()
                .map(Into::into)
                .enumerate()
                .filter(|(_, s)| !s.is_empty())
                .collect(),
        }
    }

    /// True when there is no stop string.
    pub fn is_empty(&self) -> bool {
        self.strings.is_empty()
    }

    /// The earliest match in `text` (ties: the first listed string).
    pub fn find(&self, text: &str) -> Option<StopMatch> {
        self.find_ending_after(text, 0)
    }

    /// The earliest match in `text` that ends past byte `after` (ties: the first listed string):
    /// matches within `text[..after]` are ignored.
    pub fn find_ending_after(&self, text: &str, after: usize) -> Option<StopMatch> {
        self.strings
            .iter()
            .filter_map(|(index, s)| {
                // (Matches may overlap: each start is tried, not only non-overlapping ones.)
                let mut from = 0;
                while let Some(i) = text[from..].find(s.as_str()) {
                    let start = from + i;
                    if start + s.len() > after {
                        return Some(StopMatch {
                            start,
                            end: start + s.len(),
                            index: *index,
                        });
                    }
                    from = start + text[start..].chars().next().map_or(1, char::len_utf8);
                }
                None
            })
            .min_by_key(|m| (m.start, m.index))
    }

    /// Bytes at the end of `text` that could begin a stop string (always on a char boundary).
    pub fn holdback(&self, text: &str) -> usize {
        let mut hold = 0;
        for (_, s) in &self.strings {
            for n in (1..s.len().min(text.len() + 1)).rev() {
                if s.is_char_boundary(n) && text.ends_with(&s[..n]) {
                    hold = hold.max(n);
                    break;
                }
            }
        }
        hold
    }
}
