//! Streaming detokenisation: the text of each new token as it arrives, cut at stop strings.

use crate::StopStrings;

/// Token ids to text: a tokenizer's decode (which special tokens it skips is the caller's
/// choice). An incomplete UTF-8 sequence at the end decodes as U+FFFD, as byte-level tokenizers
/// give it.
pub trait Detokenize: Send + Sync {
    /// The text of `ids`; an error says why they cannot be decoded.
    fn decode(&self, ids: &[u32]) -> Result<String, String>;

    /// The text of `ids` with special tokens written out (vLLM's `skip_special_tokens:
    /// false`); [`Self::decode`]'s where a detokenizer makes no difference.
    fn decode_special(&self, ids: &[u32]) -> Result<String, String> {
        self.decode(ids)
    }
}

impl<F: Fn(&[u32]) -> Result<String, String> + Send + Sync> Detokenize for F {
    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self(ids)
    }
}

/// Incremental detokenisation for streaming: decodes only the tokens after the last complete
/// character (so a long generation costs O(n), not O(n²)), cuts the text at a stop string, and
/// holds back a tail that may start a stop string or is an incomplete UTF-8 sequence.
#[derive(Debug, Clone)]
pub struct TextStream {
    stops: StopStrings,
    /// Longest stop string in bytes: how far back a new match can start.
    stop_len: usize,
    tokens: Vec<u32>,
    text: String,
    /// `text[..settled_bytes]` is the decode of `tokens[..settled_tokens]` and ends on a complete
    /// character; the rest is the decode of the newer tokens, redone on every push.
    settled_tokens: usize,
    settled_bytes: usize,
    emitted: usize,
    stopped_by: Option<usize>,
    /// Stop strings are not looked for until the output has more tokens than this.
    min_tokens: usize,
    /// Bytes of the settled text of the first `min_tokens` tokens (a character they leave
    /// unfinished is not in it): a match ending within them is ignored.
    quiet: usize,
    /// The text ends after a matched stop string rather than before it.
    keep_stop: bool,
    /// Special tokens are written out ([`Detokenize::decode_special`]).
    keep_special: bool,
}

/// The largest char boundary of `s` at or below `i`.
fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl TextStream {
    /// A stream that stops at any of `stop_strings` (empty strings are ignored).
    pub fn new(stop_strings: &[String]) -> Self {
        Self {
            stop_len: stop_strings.iter().map(String::len).max().unwrap_or(0),
            stops: StopStrings::new(stop_strings.iter().cloned()),
            tokens: Vec::new(),
            text: String::new(),
            settled_tokens: 0,
            settled_bytes: 0,
            emitted: 0,
            stopped_by: None,
            min_tokens: 0,
            quiet: 0,
            keep_stop: false,
            keep_special: false,
        }
    }

    /// Ignores stop strings until the output has more than `min_tokens` tokens (vLLM's
    /// `min_tokens`): only a match ending in a later token's text stops it.
    pub fn min_tokens(mut self, min_tokens: usize) -> Self {
        self.min_tokens = min_tokens;
        self
    }

    /// Ends the text after a matched stop string, not before it (vLLM's
    /// `include_stop_str_in_output`).
    pub fn keep_stop_strings(mut self, keep: bool) -> Self {
        self.keep_stop = keep;
        self
    }

    /// Writes special tokens out in the text (vLLM's `skip_special_tokens: false`).
    pub fn keep_special_tokens(mut self, keep: bool) -> Self {
        self.keep_special = keep;
        self
    }

    /// Adds a token; returns the newly printable text and whether generation may go on (false
    /// once a stop string matched: the text ends where it starts).
    pub fn push(&mut self, token: u32, decoder: &dyn Detokenize) -> Result<(String, bool), String> {
        self.tokens.push(token);
        let t = &mut self.text;
        let unsettled = &self.tokens[self.settled_tokens..];
        let tail = match self.keep_special {
            true => decoder.decode_special(unsettled)?,
            false => decoder.decode(unsettled)?,
        };
        t.truncate(self.settled_bytes);
        t.push_str(&tail);
        if !tail.ends_with('\u{FFFD}') {
            self.settled_tokens = self.tokens.len();
            self.settled_bytes = t.len();
        }
        let mut go_on = true;
        if self.tokens.len() <= self.min_tokens {
            self.quiet = self.settled_bytes;
        }
        // Only text that could contain a new match: the stop length back from the last emission.
        let from = floor_boundary(t, self.emitted.saturating_sub(self.stop_len));
        let found = match self.tokens.len() > self.min_tokens {
            true => self
                .stops
                .find_ending_after(&t[from..], self.quiet.saturating_sub(from)),
            false => None,
        };
        if let Some(m) = found {
            t.truncate(from + if self.keep_stop { m.end } else { m.start });
            self.settled_bytes = self.settled_bytes.min(t.len());
            self.stopped_by = Some(m.index);
            go_on = false;
        }
        let mut end = t.len() - if go_on { self.stops.holdback(t) } else { 0 };
        while go_on && t[..end].ends_with('\u{FFFD}') {
            end -= '\u{FFFD}'.len_utf8();
        }
        let piece = if end > self.emitted {
            t[self.emitted..end].to_string()
        } else {
            String::new()
        };
        self.emitted = self.emitted.max(end);
        Ok((piece, go_on))
    }

    /// Text still held back when generation ends.
    pub fn finish(&mut self) -> String {
        if self.text.len() > self.emitted {
            let tail = self.text[self.emitted..].to_string();
            self.emitted = self.text.len();
            tail
        } else {
            String::new()
        }
    }

    /// The whole text so far (cut at a stop string).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The text, consuming the stream.
    pub fn into_text(self) -> String {
        self.text
    }

    /// Whether a matched stop string stays in the text ([`Self::keep_stop_strings`]).
    pub fn keeps_stop_strings(&self) -> bool {
        self.keep_stop
    }

    /// Which stop string matched, once one did.
    pub fn stopped_by(&self) -> Option<usize> {
        self.stopped_by
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level vocabulary: token i is `PIECES[i]`'s bytes; an incomplete UTF-8 tail decodes
    /// as U+FFFD.
    const PIECES: [&[u8]; 6] = [b"Hel", b"lo ", b"wor", b"ld", &[0xE2, 0x82], &[0xAC]];

    fn decode(ids: &[u32]) -> Result<String, String> {
        let bytes: Vec<u8> = ids
            .iter()
            .map(|&i| PIECES.get(i as usize).copied().ok_or(format!("no token {i}")))
            .collect::<Result<Vec<_>, _>>()?
            .concat();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn run(tokens: &[u32], stops: &[&str]) -> (Vec<String>, bool, TextStream) {
        run_with(tokens, stops, 0, false)
    }

    fn run_with(
        tokens: &[u32],
        stops: &[&str],
        min_tokens: usize,
        keep: bool,
    ) -> (Vec<String>, bool, TextStream) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = TextStream::new(&stops)
            .min_tokens(min_tokens)
            .keep_stop_strings(keep);
        let mut pieces = Vec::new();
        for &t in tokens {
            let (piece, go_on) = s.push(t, &decode).unwrap();
            pieces.push(piece);
            if !go_on {
                return (pieces, false, s);
            }
        }
        (pieces, true, s)
    }

    /// Pieces concatenate to the text; a character split across tokens is held until complete.
    #[test]
    fn split_characters_wait_for_their_last_byte() {
        let (pieces, go_on, mut s) = run(&[0, 1, 4, 5, 3], &[]);
        assert!(go_on);
        assert_eq!(pieces, ["Hel", "lo ", "", "€", "ld"]);
        assert_eq!(s.text(), "Hello €ld");
        assert_eq!(s.finish(), "");
    }

    /// A stop string across token boundaries ends the stream where it starts; the text that might
    /// begin one is held back until it cannot, and what is held at the end comes out of finish.
    #[test]
    fn stop_strings_cut_the_text_and_hold_back_their_prefixes() {
        let (pieces, go_on, s) = run(&[0, 1, 2, 3], &["o wo"]);
        assert!(!go_on);
        assert_eq!(pieces, ["Hel", "l", ""]);
        assert_eq!(s.text(), "Hell");
        assert_eq!(s.stopped_by(), Some(0));
        // The "l" that could begin "lo!" is held until the next token shows it does not.
        let (pieces, go_on, mut s) = run(&[0, 1, 3], &["xyz", "lo!"]);
        assert!(go_on);
        assert_eq!(pieces, ["He", "llo ", "ld"]);
        assert_eq!(s.finish(), "");
        let (_, _, mut s2) = run(&[0, 1, 2], &["world"]);
        assert_eq!(s2.finish(), "wor");
        assert_eq!(s2.stopped_by(), None);
        let (_, _, s3) = run(&[0], &[]);
        assert_eq!(s3.into_text(), "Hel");
        // A match's index is its string's place in the list given, empty strings counted.
        let (_, go_on, s4) = run(&[0, 1, 2], &["", "lo "]);
        assert!(!go_on);
        assert_eq!(s4.stopped_by(), Some(1));
    }

    /// With `min_tokens`, a match within the first tokens' text is ignored, one ending in a later
    /// token's text (even if it starts earlier) stops; a kept stop string ends the text.
    #[test]
    fn min_tokens_delays_stop_strings_and_kept_ones_end_the_text() {
        let (_, go_on, s) = run_with(&[0, 1, 2, 3], &["lo"], 2, false);
        assert!(go_on);
        assert_eq!(s.text(), "Hello world");
        let (_, go_on, s) = run_with(&[0, 1, 2, 3], &["lo"], 1, false);
        assert!(!go_on);
        assert_eq!(s.text(), "Hel");
        let (_, go_on, s) = run_with(&[0, 1, 2, 3], &["o w"], 2, false);
        assert!(!go_on);
        assert_eq!(s.text(), "Hell");
        let (pieces, go_on, s) = run_with(&[0, 1, 2, 3], &["lo "], 0, true);
        assert!(!go_on);
        assert_eq!(pieces, ["He", "llo "]);
        assert_eq!(s.text(), "Hello ");
        assert_eq!(s.stopped_by(), Some(0));
        // Overlapping matches: the first one ending past the quiet text is found.
        let stops = StopStrings::new(["aa"]);
        let m = stops.find_ending_after("aaa", 2).unwrap();
        assert_eq!((m.start, m.end), (1, 3));
        assert_eq!(stops.find_ending_after("aaé", 2), None);
        assert_eq!(stops.find_ending_after("éaa", 0).map(|m| m.end), Some(4));
        let wide = StopStrings::new(["éé"]).find_ending_after("ééé", 4).unwrap();
        assert_eq!((wide.start, wide.end), (2, 6));
        // A character the first tokens leave unfinished is the next token's text.
        let (_, go_on, s) = run_with(&[0, 4, 5], &["€"], 2, false);
        assert!(!go_on);
        assert_eq!(s.text(), "Hel");
    }

    /// A stop string at the very start of the text, split across tokens, is found; a text that
    /// starts with a multi-byte character is searched from a character boundary.
    #[test]
    fn stop_strings_at_the_start_and_after_wide_characters() {
        let (pieces, go_on, s) = run(&[0, 1], &["Hello"]);
        assert!(!go_on);
        assert_eq!(pieces, ["", ""]);
        assert_eq!(s.text(), "");
        let (pieces, go_on, _) = run(&[4, 5, 0, 1], &["zz"]);
        assert!(go_on);
        assert_eq!(pieces, ["", "€", "Hel", "lo "]);
    }

    /// A decode error is the caller's, unchanged.
    #[test]
    fn decode_errors_pass_through() {
        let mut s = TextStream::new(&[]);
        assert_eq!(s.push(9, &decode).unwrap_err(), "no token 9");
    }

    /// Token 9 is special: skipped by `decode`, `<|9|>` in `decode_special`.
    struct Special;

    impl Detokenize for Special {
        fn decode(&self, ids: &[u32]) -> Result<String, String> {
            decode(&ids.iter().copied().filter(|&i| i != 9).collect::<Vec<_>>())
        }

        fn decode_special(&self, ids: &[u32]) -> Result<String, String> {
            let parts: Result<Vec<String>, String> = ids
                .iter()
                .map(|&i| if i == 9 { Ok("<|9|>".into()) } else { decode(&[i]) })
                .collect();
            parts.map(|p| p.concat())
        }
    }

    /// A stream that keeps special tokens reads `decode_special`, one that does not `decode`; a
    /// stop string may match a special token's text only where it is written out.
    #[test]
    fn special_tokens_are_written_out_when_kept() {
        let stops = vec!["<|9|>".to_string()];
        for (keep, want, go_on) in [(false, "Hello world", true), (true, "Hello ", false)] {
            let mut s = TextStream::new(&stops).keep_special_tokens(keep);
            let mut text = String::new();
            let mut last = true;
            for t in [0, 1, 9, 2, 3] {
                let (piece, on) = s.push(t, &Special).unwrap();
                text.push_str(&piece);
                last = on;
                if !on {
                    break;
                }
            }
            text.push_str(&s.finish());
            assert_eq!((text.as_str(), last), (want, go_on), "keep {keep}");
        }
        // A plain function decodes special tokens as it decodes the rest.
        assert_eq!(Detokenize::decode_special(&decode, &[0, 1]).unwrap(), "Hello ");
    }
}
