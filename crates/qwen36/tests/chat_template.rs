//! The chat template against HF transformers: every case of tests/fixtures/chat_templates.json
//! (written by tools/reference/chat_template_reference.py) must render byte for byte as
//! transformers' `apply_chat_template(tokenize=False)`, or fail with transformers' message.

use qwen36::{ChatMessage, ChatTemplate};
use serde_json::{Map, Value};

/// The bundled model's template before tool support; plain chats must still render the same.
const PLAIN_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}";

fn bundled() -> ChatTemplate {
    let path = qwen36_testutil::bundled_dir().join("tokenizer_config.json");
    ChatTemplate::from_tokenizer_config(&path)
        .expect("tokenizer_config.json loads")
        .expect("tokenizer_config.json has a chat_template")
}

/// One recorded transformers rendering.
struct Case {
    name: String,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: bool,
    kwargs: Map<String, Value>,
    /// The case's own template (a string), or named ones in place of the tokenizer's (an object).
    template: Option<Value>,
    expected: Result<String, String>,
}

fn cases() -> Vec<Case> {
    let path = qwen36_testutil::crate_fixture("qwen36", "chat_templates.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let all: Vec<Value> = serde_json::from_str(&text).expect("fixture is JSON");
    all.into_iter()
        .map(|c| Case {
            name: c["name"].as_str().expect("name").to_string(),
            messages: c["messages"].as_array().expect("messages").clone(),
            tools: c["tools"].as_array().cloned(),
            add_generation_prompt: c["add_generation_prompt"]
                .as_bool()
                .expect("add_generation_prompt"),
            kwargs: c["kwargs"].as_object().cloned().unwrap_or_default(),
            template: c.get("template").cloned(),
            expected: match (&c.get("rendered"), &c.get("error")) {
                (Some(Value::String(s)), _) => Ok(s.clone()),
                (_, Some(Value::String(e))) => Err(e.clone()),
                _ => panic!("case without `rendered` or `error`: {c}"),
            },
        })
        .collect()
}

/// Where two renderings first differ: byte offset, line and column, and both texts around it.
fn first_difference(got: &str, want: &str, want_label: &str) -> String {
    let at = got
        .bytes()
        .zip(want.bytes())
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let line = want[..at].matches('\n').count() + 1;
    let col = at - want[..at].rfind('\n').map_or(0, |i| i + 1);
    let around = |s: &str| {
        let mut lo = at.saturating_sub(40).min(s.len());
        while !s.is_char_boundary(lo) {
            lo -= 1;
        }
        let mut hi = (at + 40).min(s.len());
        while !s.is_char_boundary(hi) {
            hi += 1;
        }
        format!("{:?}", &s[lo..hi])
    };
    format!(
        "first difference at byte {at} (line {line}, column {col}; lengths {} vs {}):\n  {:<13} {}\n  {:<13} {}",
        got.len(),
        want.len(),
        "ours:",
        around(got),
        format!("{want_label}:"),
        around(want)
    )
}

/// The bundled tokenizer config with `named` as its list of named templates, read back.
fn named_templates(dir: &std::path::Path, named: &Map<String, Value>) -> ChatTemplate {
    let path = qwen36_testutil::bundled_dir().join("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    config["chat_template"] = named
        .iter()
        .map(|(name, template)| serde_json::json!({"name": name, "template": template}))
        .collect();
    let path = dir.join("tokenizer_config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    ChatTemplate::from_tokenizer_config(&path)
        .expect("the fixture's templates compile")
        .expect("a template")
}

#[test]
fn renders_like_transformers() {
    let base = bundled();
    let cases = cases();
    assert!(cases.len() >= 10, "only {} fixture cases", cases.len());
    let mut failures = Vec::new();
    let dir = tempfile::tempdir().unwrap();
    for case in &cases {
        let template = match &case.template {
            None => base.clone(),
            Some(Value::String(s)) => base
                .with_source(s.as_str())
                .expect("the fixture's templates compile"),
            Some(Value::Object(named)) => named_templates(dir.path(), named),
            Some(other) => panic!("{}: template {other}", case.name),
        };
        let got = template.render_json(
            &case.messages,
            case.tools.as_deref(),
            case.add_generation_prompt,
            &case.kwargs,
        );
        match (&case.expected, got) {
            (Ok(want), Ok(got)) if &got == want => {}
            (Ok(want), Ok(got)) => failures.push(format!(
                "{}: {}",
                case.name,
                first_difference(&got, want, "transformers")
            )),
            (Ok(_), Err(e)) => failures.push(format!("{}: transformers renders it, we fail: {e}", case.name)),
            (Err(msg), Err(e)) if e.to_string().contains(msg.as_str()) => {}
            (Err(msg), Err(e)) => failures.push(format!(
                "{}: error {e:?} lacks transformers' message {msg:?}",
                case.name
            )),
            (Err(msg), Ok(got)) => failures.push(format!(
                "{}: transformers raises {msg:?}, we render {got:?}",
                case.name
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from transformers:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn raise_exception_message_reaches_the_error() {
    let err = bundled()
        .render_json(
            &[serde_json::json!({"role": "narrator", "content": "x"})],
            None,
            true,
            &Map::new(),
        )
        .expect_err("an unknown role is rejected");
    let msg = err.to_string();
    assert!(msg.contains("Unknown message role: narrator"), "{msg}");
    assert!(msg.contains("raised an exception"), "{msg}");
}

#[test]
fn renderer_variables_cannot_be_overridden() {
    let mut extra = Map::new();
    extra.insert("messages".into(), Value::Array(vec![]));
    let err = bundled()
        .render_json(&[], None, false, &extra)
        .expect_err("`messages` is reserved");
    assert!(err.to_string().contains("`messages`"), "{err}");
}

/// The fixture cases that `ChatTemplate::render` can express: bundled template, string role and
/// content only, no tools, no kwargs but `enable_thinking`.
fn plain_cases() -> Vec<(Case, Vec<ChatMessage>, bool)> {
    cases()
        .into_iter()
        .filter(|c| c.template.is_none() && c.tools.is_none() && c.expected.is_ok())
        .filter(|c| c.kwargs.keys().all(|k| k == "enable_thinking"))
        .filter_map(|c| {
            let msgs = c
                .messages
                .iter()
                .map(|m| {
                    let (role, content) = (m.get("role")?.as_str()?, m.get("content")?.as_str()?);
                    let plain = m.as_object()?.len() == 2 && ["system", "user", "assistant"].contains(&role);
                    plain.then(|| ChatMessage::new(role, content))
                })
                .collect::<Option<Vec<_>>>()?;
            // An absent `enable_thinking` renders like `true` in this template.
            let thinking = c
                .kwargs
                .get("enable_thinking")
                .map_or(Some(true), Value::as_bool)?;
            Some((c, msgs, thinking))
        })
        .collect()
}

#[test]
fn plain_render_matches_json_render() {
    let template = bundled();
    let plain = plain_cases();
    assert!(plain.len() >= 5, "only {} plain cases", plain.len());
    for (case, msgs, thinking) in &plain {
        let got = template
            .render(msgs, case.add_generation_prompt, *thinking)
            .expect("renders");
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), Value::Bool(*thinking));
        let json = template
            .render_json(&case.messages, None, case.add_generation_prompt, &kwargs)
            .expect("renders");
        assert_eq!(
            got,
            json,
            "{}: {}",
            case.name,
            first_difference(&got, &json, "render_json")
        );
        let want = case.expected.as_ref().expect("plain cases render");
        assert_eq!(
            &got,
            want,
            "{}: {}",
            case.name,
            first_difference(&got, want, "transformers")
        );
    }
}

#[test]
fn plain_chats_render_as_the_previous_template() {
    let template = bundled();
    let previous = template.with_source(PLAIN_TEMPLATE).unwrap();
    for (case, msgs, thinking) in plain_cases() {
        for gen in [false, true] {
            let got = template.render(&msgs, gen, thinking).expect("renders");
            let want = previous.render(&msgs, gen, thinking).expect("renders");
            assert_eq!(
                got,
                want,
                "{} (gen {gen}): {}",
                case.name,
                first_difference(&got, &want, "previous")
            );
        }
    }
}

/// A checkpoint directory's template: `chat_template.jinja` over tokenizer_config.json's (with
/// the config's special tokens), a list of named templates gives the "default" one, and a
/// `chat_template` of another type is an error naming the file and field, not "no template".
#[test]
fn a_directory_template_comes_from_the_jinja_file_or_the_config() {
    let bundled_dir = qwen36_testutil::bundled_dir();
    let dir = std::env::temp_dir().join(format!("qwen36-chatdir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(bundled_dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    let write_config = |chat_template: Value| {
        let mut c = config.clone();
        c["chat_template"] = chat_template;
        std::fs::write(dir.join("tokenizer_config.json"), c.to_string()).unwrap();
    };
    let hi = [ChatMessage::new("user", "hi")];
    // The config's own template: as the bundled model's.
    write_config(config["chat_template"].clone());
    let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    assert_eq!(t.source(), bundled().source());
    // A list of named templates: the default one.
    write_config(serde_json::json!([
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": PLAIN_TEMPLATE}
    ]));
    let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    assert_eq!(t.source(), PLAIN_TEMPLATE);
    // The .jinja file wins, and sees the config's special tokens.
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ eos_token }}|{{ messages[0]['content'] }}",
    )
    .unwrap();
    let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    let eos = config["eos_token"].as_str().unwrap_or_default();
    assert_eq!(t.render(&hi, false, true).unwrap(), format!("{eos}|hi"));
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    // Neither: none; another type: an error.
    write_config(Value::Null);
    assert!(ChatTemplate::from_dir(&dir).unwrap().is_none());
    write_config(serde_json::json!(3));
    let e = ChatTemplate::from_dir(&dir).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("chat_template"),
        "{e}"
    );
    // Named templates without `default`: `tool_use` serves requests with tools (others fail
    // as transformers does); without either, the list is refused when read.
    write_config(serde_json::json!([{"name": "tool_use", "template": "TOOLS"}]));
    let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    let user = [serde_json::json!({"role": "user", "content": "hi"})];
    let tool = [serde_json::json!({"type": "function", "function": {"name": "f"}})];
    // Renders `t` for one user message, with a tool or without.
    let render = |t: &ChatTemplate, tools: bool| {
        t.render_json(&user, tools.then_some(&tool[..]), false, &Map::new())
            .map_err(|e| e.to_string())
    };
    assert_eq!(render(&t, true).unwrap(), "TOOLS");
    let e = render(&t, false).unwrap_err();
    assert!(
        e.contains("no default specified") && e.contains("['tool_use']"),
        "{e}"
    );
    // Neither: every request fails (the template is never rendered, so it need not compile);
    // of two of one name, the last.
    write_config(serde_json::json!([{"name": "rag", "template": "{% if %}"}]));
    let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    for tools in [false, true] {
        let e = render(&t, tools).unwrap_err();
        assert!(e.contains("no default specified") && e.contains("['rag']"), "{e}");
    }
    write_config(serde_json::json!([
        {"name": "default", "template": "FIRST"},
        {"name": "default", "template": "LAST"}
    ]));
    let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    assert_eq!(
        (render(&t, false).unwrap().as_str(), t.source()),
        ("LAST", "LAST")
    );
    // A malformed list is an error, unless a template file is given instead.
    write_config(serde_json::json!([{"name": "default"}]));
    let e = ChatTemplate::from_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("list entry"), "{e}");
    let file = dir.join("given.jinja");
    std::fs::write(&file, "GIVEN").unwrap();
    let t = ChatTemplate::from_dir_with(&dir, Some(&file)).unwrap().unwrap();
    assert_eq!(render(&t, true).unwrap(), "GIVEN");
    std::fs::remove_file(file).unwrap();
    // The files as newer transformers save named templates: they replace the config's list.
    write_config(serde_json::json!([{"name": "default", "template": "CONFIG"}]));
    std::fs::create_dir_all(dir.join("additional_chat_templates")).unwrap();
    std::fs::write(dir.join("additional_chat_templates/tool_use.jinja"), "FILE TOOLS").unwrap();
    std::fs::write(dir.join("chat_template.jinja"), "FILE DEFAULT").unwrap();
    let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    assert_eq!(render(&t, true).unwrap(), "FILE TOOLS");
    assert_eq!(render(&t, false).unwrap(), "FILE DEFAULT");
    assert!(t.path().ends_with("chat_template.jinja"));
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    let e = render(&t, false).unwrap_err();
    assert!(
        e.contains("tool_use.jinja") && e.contains("no default specified"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A template that does not compile is refused when it is read, naming its file and line (it
/// used to pass the load and fail every chat request), from either file and as an override.
#[test]
fn a_template_that_does_not_compile_is_refused_when_read() {
    let dir = std::env::temp_dir().join(format!("qwen36-badtemplate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let broken = "line one\nline two\n{{ messages[0]['content'] ) }}\nline four";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({ "chat_template": broken }).to_string(),
    )
    .unwrap();
    let e = ChatTemplate::from_dir(&dir).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("syntax error") && e.contains(":3"),
        "{e}"
    );
    std::fs::write(dir.join("chat_template.jinja"), "{{ messages[0]['content'] ").unwrap();
    let e = ChatTemplate::from_dir(&dir).unwrap_err().to_string();
    assert!(
        e.contains("chat_template.jinja") && e.contains("syntax error"),
        "{e}"
    );
    let e = bundled().with_source(broken).unwrap_err().to_string();
    assert!(e.contains("syntax error"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}
