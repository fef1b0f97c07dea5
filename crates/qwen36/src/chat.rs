//! Chat templates: the Jinja `chat_template` of tokenizer_config.json rendered with minijinja.

use std::path::Path;

use minijinja::{context, Environment};
use serde_json::Value;

use crate::{Error, Result};

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A model's chat template (Qwen's is ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n`).
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    path: std::path::PathBuf,
}

impl ChatTemplate {
    /// Reads `chat_template` from a tokenizer_config.json; `Ok(None)` when it has none.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>> {
        let err = |msg: String| Error::File {
            path: path.to_path_buf(),
            msg,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| err(format!("malformed JSON: {e}")))?;
        Ok(match v.get("chat_template") {
            Some(Value::String(s)) => Some(Self {
                source: s.clone(),
                path: path.to_path_buf(),
            }),
            _ => None,
        })
    }

    /// Renders `messages`; `add_generation_prompt` opens the assistant turn, `enable_thinking =
    /// false` asks Qwen templates for an empty think block.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String> {
        let mut env = Environment::new();
        // Qwen templates call Python string methods (`.startswith`, `.split`, ...).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        let err = |e: minijinja::Error| Error::File {
            path: self.path.clone(),
            msg: format!("chat_template: {e}"),
        };
        env.add_template("chat", &self.source).map_err(err)?;
        let msgs: Vec<_> = messages
            .iter()
            .map(|m| context! { role => m.role.clone(), content => m.content.clone() })
            .collect();
        env.get_template("chat")
            .and_then(|t| {
                t.render(context! {
                    messages => msgs,
                    add_generation_prompt => add_generation_prompt,
                    enable_thinking => enable_thinking,
                })
            })
            .map_err(err)
    }
}
