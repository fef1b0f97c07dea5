//! Structured output: a request's JSON schema, regex or choice list compiled by llguidance into
//! an engine [`Constraint`] that masks, at each position, the tokens the output may not take.
//! A chat that opens with a `<think>` block is constrained from the token that closes it.

use std::sync::{Arc, Mutex, PoisonError};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use qwen36::engine::{Constraint, ConstraintSpec, OutputConstraint};

/// The tokenizer's vocabulary as llguidance reads it (built once: a trie of every token's
/// bytes), and the grammar compiler over it.
pub struct Guidance {
    factory: ParserFactory,
    /// The grammars compiled last, by their JSON, the latest last: a server's requests repeat
    /// their tools and schemas, and compiling a schema takes milliseconds.
    compiled: Mutex<Vec<(String, Arc<TokenParser>)>>,
}

/// How many compiled grammars [`Guidance`] keeps.
const COMPILED_KEPT: usize = 32;

/// The tokenizer behind a trie of its tokens' bytes (what llguidance asks of a tokenizer).
struct TokenizerBytes {
    trie: TokTrie,
    tokenizer: qwen36::Tokenizer,
}

impl TokenizerEnv for TokenizerBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's ids for text; bytes that are not UTF-8 (part of a character) by the
    /// trie's greedy match, never as a replacement character.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

impl Guidance {
    /// The compiler for `tokenizer`'s vocabulary, whose end is any of `eos` (the model's stop
    /// ids: a finished grammar allows only them).
    pub fn new(tokenizer: &qwen36::Tokenizer, eos: &[u32]) -> Result<Self, String> {
        let json = tokenizer
            .to_string(false)
            .map_err(|e| format!("tokenizer: {e}"))?;
        let json: serde_json::Value = serde_json::from_str(&json).map_err(|e| format!("tokenizer: {e}"))?;
        let words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| format!("tokenizer: {e}"))?;
        let Some(&first) = eos.first() else {
            return Err("structured output needs the model's end-of-turn id".into());
        };
        let info = TokRxInfo::new(words.len() as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(TokenizerBytes {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self {
            factory,
            compiled: Mutex::new(Vec::new()),
        })
    }

    /// `grammar` compiled into the spec of each choice's constraint; `think_end`: the output
    /// opens inside a `<think>` block and is constrained after this id (which closes it).
    pub fn compile(
        &self,
        grammar: TopLevelGrammar,
        think_end: Option<u32>,
    ) -> Result<OutputConstraint, String> {
        Ok(OutputConstraint(Arc::new(Spec {
            parser: self.parser(grammar)?,
            think_end,
        })))
    }

    /// `grammar`'s parser: the one compiled before for the same grammar, else a new one (kept,
    /// in place of the one used longest ago when [`COMPILED_KEPT`] are). A request starts from
    /// a copy of it, so one parser serves them all.
    fn parser(&self, grammar: TopLevelGrammar) -> Result<Arc<TokenParser>, String> {
        let key = serde_json::to_string(&grammar).map_err(|e| e.to_string())?;
        let kept = || self.compiled.lock().unwrap_or_else(PoisonError::into_inner);
        {
            let mut kept = kept();
            if let Some(i) = kept.iter().position(|(k, _)| *k == key) {
                let hit = kept.remove(i);
                let parser = hit.1.clone();
                kept.push(hit);
                return Ok(parser);
            }
        }
        let parser = Arc::new(self.factory.create_parser(grammar).map_err(|e| e.to_string())?);
        let mut kept = kept();
        // (Another request may have compiled it meanwhile: one copy is kept.)
        if let Some((_, earlier)) = kept.iter().find(|(k, _)| *k == key) {
            return Ok(earlier.clone());
        }
        if kept.len() >= COMPILED_KEPT {
            kept.remove(0);
        }
        kept.push((key, parser.clone()));
        Ok(parser)
    }
}

/// A compiled grammar: each request's constraint starts from a copy of its parser.
struct Spec {
    parser: Arc<TokenParser>,
    think_end: Option<u32>,
}

impl std::fmt::Debug for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spec")
            .field("think_end", &self.think_end)
            .finish_non_exhaustive()
    }
}

impl ConstraintSpec for Spec {
    fn start(&self) -> Result<Box<dyn Constraint>, String> {
        Ok(Box::new(Guided::new(self.parser.clone(), self.think_end)))
    }
}

/// What one followed token was to the grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Inside the think block (not constrained).
    Thinking,
    /// The id that closed the think block.
    Closed,
    /// Fed to the matcher.
    Fed,
    /// After the grammar had finished (the end-of-turn id it allows then).
    Finished,
}

/// One output's constraint: the matcher follows the tokens after the think block (or all).
struct Guided {
    matcher: Matcher,
    /// The compiled grammar, to start the matcher again after an error.
    parser: Arc<TokenParser>,
    think_end: Option<u32>,
    /// The think block is open: no token is masked.
    open: bool,
    history: Vec<Step>,
    /// The tokens fed to the matcher.
    fed: Vec<u32>,
}

impl Guided {
    fn new(parser: Arc<TokenParser>, think_end: Option<u32>) -> Self {
        Self {
            matcher: Matcher::new(Ok(parser.deep_clone())),
            parser,
            think_end,
            open: think_end.is_some(),
            history: Vec::new(),
            fed: Vec::new(),
        }
    }
}

impl std::fmt::Debug for Guided {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guided")
            .field("open", &self.open)
            .field("followed", &self.history.len())
            .finish_non_exhaustive()
    }
}

impl Constraint for Guided {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        if self.open {
            return Ok(());
        }
        let allowed = self.matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
        let known = allowed.len();
        for (t, l) in logits.iter_mut().enumerate() {
            if t >= known || !allowed.is_allowed(t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn consume(&mut self, tokens: &[u32]) -> Result<(), String> {
        for &t in tokens {
            let step = if self.open {
                match Some(t) == self.think_end {
                    true => Step::Closed,
                    false => Step::Thinking,
                }
            } else if let Some(e) = self.matcher.get_error() {
                return Err(e);
            } else if self.matcher.is_stopped() {
                Step::Finished
            } else {
                self.matcher.consume_token(t).map_err(|e| e.to_string())?;
                self.fed.push(t);
                Step::Fed
            };
            self.open &= step != Step::Closed;
            self.history.push(step);
        }
        Ok(())
    }

    fn rollback(&mut self, n: usize) -> Result<(), String> {
        let start = self
            .history
            .len()
            .checked_sub(n)
            .ok_or_else(|| format!("rollback of {n} tokens after {}", self.history.len()))?;
        let gone = self.history.split_off(start);
        let fed = gone.iter().filter(|&&s| s == Step::Fed).count();
        self.fed.truncate(self.fed.len() - fed);
        if self.matcher.is_error() {
            // A mask that failed after tried drafts leaves the matcher in its error state, which
            // takes no rollback: it starts again and follows the tokens kept.
            self.matcher = Matcher::new(Ok(self.parser.deep_clone()));
            self.matcher
                .consume_tokens(&self.fed)
                .map_err(|e| e.to_string())?;
        } else if fed > 0 {
            self.matcher.rollback(fed).map_err(|e| e.to_string())?;
        }
        // (The think block's end was among them: it is open again.)
        self.open |= gone.contains(&Step::Closed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The think block is not constrained; the grammar starts after the id that closes it
    /// (allowing only prefixes of its words, then only the end-of-turn id); a rollback across
    /// that id opens the block again, and one past the start is an error.
    #[test]
    fn the_grammar_starts_after_the_think_block() {
        let dir = qwen36_testutil::bundled_dir();
        let tokenizer = qwen36::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let end = tokenizer.token_to_id("<|im_end|>").unwrap();
        let think_end = tokenizer.token_to_id("</think>").unwrap();
        let g = Guidance::new(&tokenizer, &[end]).unwrap();
        let spec = g
            .compile(TopLevelGrammar::from_regex("yes|no"), Some(think_end))
            .unwrap();
        let mut c = spec.0.start().unwrap();
        let vocab = tokenizer.get_vocab_size(true);
        let allowed = |c: &mut Box<dyn Constraint>| -> Vec<u32> {
            let mut row = vec![0f32; vocab + 3];
            c.mask(&mut row).unwrap();
            (0..row.len() as u32)
                .filter(|&t| row[t as usize] == 0.0)
                .collect()
        };
        assert_eq!(allowed(&mut c).len(), vocab + 3, "inside the think block");
        let thought = tokenizer.encode("hmm, yes", false).unwrap().get_ids().to_vec();
        c.consume(&thought).unwrap();
        assert_eq!(allowed(&mut c).len(), vocab + 3, "inside the think block");
        c.consume(&[think_end]).unwrap();
        let first = allowed(&mut c);
        assert!(!first.is_empty());
        for &t in &first {
            let text = tokenizer.decode(&[t], false).unwrap();
            assert!(
                !text.is_empty() && ("yes".starts_with(&text) || "no".starts_with(&text)),
                "{text:?}"
            );
        }
        let yes = tokenizer.encode("yes", false).unwrap().get_ids().to_vec();
        c.consume(&yes).unwrap();
        assert_eq!(allowed(&mut c), vec![end], "a finished grammar allows its end");
        c.consume(&[end]).unwrap();
        c.rollback(1 + yes.len()).unwrap();
        assert_eq!(allowed(&mut c), first, "the tokens tried are forgotten");
        c.rollback(1).unwrap();
        assert_eq!(allowed(&mut c).len(), vocab + 3, "the think block is open again");
        c.consume(&[think_end]).unwrap();
        assert_eq!(allowed(&mut c), first);
        let followed = thought.len() + 1;
        assert!(c.rollback(followed + 1).is_err());
    }

    /// A grammar compiled again is the parser compiled before, which a request's constraint
    /// only copies (one that followed tokens leaves it as it was); another grammar, or the same
    /// one after [`COMPILED_KEPT`] others used since, is compiled anew.
    #[test]
    fn compiled_grammars_are_kept() {
        let dir = qwen36_testutil::bundled_dir();
        let tokenizer = qwen36::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let end = tokenizer.token_to_id("<|im_end|>").unwrap();
        let g = Guidance::new(&tokenizer, &[end]).unwrap();
        let rx = |r: &str| g.parser(TopLevelGrammar::from_regex(r)).unwrap();
        let (a, b) = (rx("yes|no"), rx("[0-9]+"));
        assert!(!Arc::ptr_eq(&a, &b));
        let mask = |c: &mut Box<dyn Constraint>| {
            let mut row = vec![0f32; tokenizer.get_vocab_size(true)];
            c.mask(&mut row).unwrap();
            row
        };
        let spec = g.compile(TopLevelGrammar::from_regex("yes|no"), None).unwrap();
        let mut first = spec.0.start().unwrap();
        let fresh = mask(&mut first);
        first
            .consume(tokenizer.encode("yes", false).unwrap().get_ids())
            .unwrap();
        assert_ne!(mask(&mut first), fresh);
        let again = g.compile(TopLevelGrammar::from_regex("yes|no"), None).unwrap();
        assert_eq!(mask(&mut again.0.start().unwrap()), fresh);
        assert!(Arc::ptr_eq(&a, &rx("yes|no")), "the latest used is now yes|no");
        for i in 0..COMPILED_KEPT - 1 {
            rx(&format!("x{{{i}}}"));
        }
        assert!(Arc::ptr_eq(&a, &rx("yes|no")));
        assert!(!Arc::ptr_eq(&b, &rx("[0-9]+")), "used longest ago: compiled anew");
    }

    /// A matcher left in its error state (a mask that failed after tried drafts) starts again
    /// on rollback, following the tokens kept: its masks are those before the tried ones; a
    /// token followed in the error state is refused.
    #[test]
    fn a_rollback_recovers_from_an_error() {
        let dir = qwen36_testutil::bundled_dir();
        let tokenizer = qwen36::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let end = tokenizer.token_to_id("<|im_end|>").unwrap();
        let g = Guidance::new(&tokenizer, &[end]).unwrap();
        let grammar = TopLevelGrammar::from_regex("[a-z]+ [0-9]+");
        let mut c = Guided::new(Arc::new(g.factory.create_parser(grammar).unwrap()), None);
        let mask = |c: &mut Guided| {
            let mut row = vec![0f32; tokenizer.get_vocab_size(true)];
            c.mask(&mut row).unwrap();
            row
        };
        let word = tokenizer.encode("abc", false).unwrap().get_ids().to_vec();
        c.consume(&word).unwrap();
        let before = mask(&mut c);
        let tried = tokenizer.encode(" 1", false).unwrap().get_ids().to_vec();
        c.consume(&tried).unwrap();
        c.matcher.test_trigger_lexer_error().ok();
        assert!(c.matcher.is_error());
        assert!(
            c.consume(&word).is_err(),
            "no token is followed in the error state"
        );
        c.rollback(tried.len()).unwrap();
        assert!(!c.matcher.is_error());
        assert_eq!(mask(&mut c), before);
    }
}
