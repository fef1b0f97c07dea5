//! vLLM's `guided_grammar`: a grammar in llguidance's Lark syntax, or in llama.cpp's GBNF (rules
//! written `name ::= ...`, as vLLM's examples and xgrammar take them), which is rewritten into
//! Lark for llguidance.
//!
//! GBNF's rule bodies run until the next `name ::=` and may span lines; Lark's end at a newline,
//! its rule names are lowercase and its character classes are regexes. The rewrite puts each
//! rule on one line, renames every rule `g-<name>` (`root` is `start`'s one expansion), writes
//! strings in Lark's JSON form and classes and `.` as `/[...]/` regexes of `\x{..}` code points.

/// `text` as a Lark grammar: GBNF (a rule defined with `::=`) rewritten, Lark as given.
pub fn to_lark(text: &str) -> Result<String, String> {
    if !is_gbnf(text) {
        return Ok(text.to_string());
    }
    let tokens = lex(text)?;
    let mut rules: Vec<(String, Vec<String>)> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let (Tok::Name(name), Some(Tok::Defines)) = (&tokens[i], tokens.get(i + 1)) else {
            return Err(format!(
                "GBNF: expected a rule (name ::= ...), found {}",
                tokens[i].describe()
            ));
        };
        i += 2;
        let mut body = Vec::new();
        while i < tokens.len()
            && !matches!(
                (&tokens[i], tokens.get(i + 1)),
                (Tok::Name(_), Some(Tok::Defines))
            )
        {
            body.push(tokens[i].lark());
            i += 1;
        }
        if rules.iter().any(|(n, _)| n == name) {
            return Err(format!("GBNF: rule {name} is defined twice"));
        }
        rules.push((name.clone(), body));
    }
    if !rules.iter().any(|(n, _)| n == "root") {
        return Err("GBNF: no root rule (root ::= ...)".into());
    }
    let mut out = format!("start: {}\n", rule_name("root"));
    for (name, body) in rules {
        let body = if body.is_empty() {
            "\"\"".to_string()
        } else {
            body.join(" ")
        };
        out.push_str(&format!("{}: {body}\n", rule_name(&name)));
    }
    Ok(out)
}

/// Whether a line of `text` starts with a name and `::=` (Lark defines with `:`).
fn is_gbnf(text: &str) -> bool {
    text.lines().any(|line| {
        let line = line.trim_start();
        let name_end = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
        line[name_end..].trim_start().starts_with("::=")
    })
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// GBNF rule `name` as a Lark rule name (lowercase only): `g-` and the name, each capital as
/// `_` and its lowercase and each `_` doubled, so distinct names stay distinct.
fn rule_name(name: &str) -> String {
    let mut out = String::from("g-");
    for c in name.chars() {
        match c {
            'A'..='Z' => {
                out.push('_');
                out.push(c.to_ascii_lowercase());
            }
            '_' => out.push_str("__"),
            c => out.push(c),
        }
    }
    out
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Defines,
    /// A string literal's characters.
    Literal(String),
    /// A character class: negated, and its ranges (a single character is a range of one).
    Class(bool, Vec<(char, char)>),
    /// `.`: any character.
    Any,
    /// `| ( ) * + ?` and repetition braces, written as they are.
    Punct(String),
}

impl Tok {
    fn describe(&self) -> String {
        match self {
            Tok::Name(n) => format!("name {n:?}"),
            Tok::Defines => "::=".into(),
            Tok::Literal(s) => format!("string {s:?}"),
            Tok::Class(..) => "a character class".into(),
            Tok::Any => "'.'".into(),
            Tok::Punct(p) => format!("{p:?}"),
        }
    }

    /// The token in Lark.
    fn lark(&self) -> String {
        match self {
            Tok::Name(n) => rule_name(n),
            Tok::Defines => unreachable!("a body ends before a definition"),
            Tok::Literal(s) => lark_string(s),
            Tok::Class(negated, ranges) => {
                let mut out = String::from(if *negated { "/[^" } else { "/[" });
                for &(a, b) in ranges {
                    out.push_str(&format!("\\x{{{:x}}}", a as u32));
                    if b != a {
                        out.push_str(&format!("-\\x{{{:x}}}", b as u32));
                    }
                }
                out.push_str("]/");
                out
            }
            Tok::Any => "/(?s:.)/".into(),
            Tok::Punct(p) => p.clone(),
        }
    }
}

/// `s` as a Lark (JSON) string literal; control characters and DEL escaped, as its lexer asks.
fn lark_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// GBNF's tokens (comments and whitespace dropped).
fn lex(text: &str) -> Result<Vec<Tok>, String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            c if c.is_whitespace() => i += 1,
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                out.push(Tok::Defines);
                i += 3;
            }
            '"' => {
                i += 1;
                let mut s = String::new();
                loop {
                    match chars.get(i) {
                        None => return Err("GBNF: a string is not closed".into()),
                        Some('"') => break,
                        Some('\\') => s.push(escape(&chars, &mut i)?),
                        Some(&c) => {
                            s.push(c);
                            i += 1;
                        }
                    }
                }
                i += 1;
                out.push(Tok::Literal(s));
            }
            '[' => {
                i += 1;
                let negated = chars.get(i) == Some(&'^');
                if negated {
                    i += 1;
                }
                let mut ranges = Vec::new();
                let one = |i: &mut usize| match chars.get(*i) {
                    None => Err("GBNF: a character class is not closed".to_string()),
                    Some('\\') => escape(&chars, i),
                    Some(&c) => {
                        *i += 1;
                        Ok(c)
                    }
                };
                while chars.get(i) != Some(&']') {
                    let a = one(&mut i)?;
                    let b = match (chars.get(i), chars.get(i + 1)) {
                        (Some('-'), Some(&next)) if next != ']' => {
                            i += 1;
                            one(&mut i)?
                        }
                        _ => a,
                    };
                    if b < a {
                        return Err(format!("GBNF: character range {a:?}-{b:?} is reversed"));
                    }
                    ranges.push((a, b));
                }
                i += 1;
                if ranges.is_empty() {
                    return Err("GBNF: an empty character class".into());
                }
                out.push(Tok::Class(negated, ranges));
            }
            '.' => {
                out.push(Tok::Any);
                i += 1;
            }
            '|' | '(' | ')' | '*' | '+' | '?' => {
                out.push(Tok::Punct(c.to_string()));
                i += 1;
            }
            '{' => {
                let end = chars[i..]
                    .iter()
                    .position(|&c| c == '}')
                    .ok_or("GBNF: a repetition {m,n} is not closed")?;
                let inner: String = chars[i + 1..i + end]
                    .iter()
                    .filter(|c| !c.is_whitespace())
                    .collect();
                if inner.is_empty() || !inner.chars().all(|c| c.is_ascii_digit() || c == ',') {
                    return Err(format!(
                        "GBNF: repetition {{{inner}}}: expected {{m}}, {{m,}} or {{m,n}}"
                    ));
                }
                out.push(Tok::Punct(format!("{{{inner}}}")));
                i += end + 1;
            }
            c if is_name_char(c) => {
                let start = i;
                while i < chars.len() && is_name_char(chars[i]) {
                    i += 1;
                }
                out.push(Tok::Name(chars[start..i].iter().collect()));
            }
            c => return Err(format!("GBNF: unexpected character {c:?}")),
        }
    }
    Ok(out)
}

/// The escape at `chars[*i]` (a backslash), as llama.cpp reads it: `\x..`, `\u....`,
/// `\U........`, `\t \r \n \\ \" \[ \]`.
fn escape(chars: &[char], i: &mut usize) -> Result<char, String> {
    let hex = |i: &mut usize, n: usize| -> Result<char, String> {
        let letter = chars[*i + 1];
        let digits: String = chars.get(*i + 2..*i + 2 + n).unwrap_or_default().iter().collect();
        let code = u32::from_str_radix(&digits, 16)
            .ok()
            .filter(|_| digits.len() == n)
            .ok_or_else(|| format!("GBNF: escape \\{letter} needs {n} hex digits"))?;
        *i += 2 + n;
        char::from_u32(code).ok_or_else(|| format!("GBNF: escape \\{letter}{digits} is not a character"))
    };
    let c = match chars.get(*i + 1) {
        Some('x') => return hex(i, 2),
        Some('u') => return hex(i, 4),
        Some('U') => return hex(i, 8),
        Some('t') => '\t',
        Some('r') => '\r',
        Some('n') => '\n',
        Some(&c @ ('\\' | '"' | '[' | ']' | '-' | '^')) => c,
        Some(c) => return Err(format!("GBNF: unknown escape \\{c}")),
        None => return Err("GBNF: a backslash ends the grammar".into()),
    };
    *i += 2;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lark_passes_through() {
        let lark = "start: \"a\" | b\nb: /[0-9]+/\n";
        assert_eq!(to_lark(lark).unwrap(), lark);
    }

    #[test]
    fn gbnf_rules_become_one_line_each() {
        let gbnf = r#"
# a comment
root ::= greeting ( " " Name )?   # trailing comment
greeting ::= "hi" |
   "hello\n"
Name ::= [A-Z] [a-z_]* "\"" .
"#;
        let want = concat!(
            "start: g-root\n",
            "g-root: g-greeting ( \" \" g-_name ) ?\n",
            "g-greeting: \"hi\" | \"hello\\u000a\"\n",
            "g-_name: /[\\x{41}-\\x{5a}]/ /[\\x{61}-\\x{7a}\\x{5f}]/ * \"\\\"\" /(?s:.)/\n",
        );
        assert_eq!(to_lark(gbnf).unwrap(), want);
    }

    #[test]
    fn names_ranges_and_comments_at_the_ends() {
        // Names with '-' and '_', a '-' ending a class, a name and a comment ending the text.
        let gbnf = "a_b ::= [a-] json-value\njson-value ::= \"x\" # last\nroot ::= a_b";
        let want = concat!(
            "start: g-root\n",
            "g-a__b: /[\\x{61}\\x{2d}]/ g-json-value\n",
            "g-json-value: \"x\"\n",
            "g-root: g-a__b\n",
        );
        assert_eq!(to_lark(gbnf).unwrap(), want);
        assert_eq!(
            to_lark("root ::= \"x\" # no newline").unwrap(),
            "start: g-root\ng-root: \"x\"\n"
        );
    }

    #[test]
    fn gbnf_escapes_and_classes() {
        let gbnf = r#"root ::= [^"\\\x00-\x1F] "\u00e9\U0001F600\t" "a"{2,3} [\]\-]"#;
        let want = concat!(
            "start: g-root\n",
            "g-root: /[^\\x{22}\\x{5c}\\x{0}-\\x{1f}]/ \"é😀\\u0009\" \"a\" {2,3} /[\\x{5d}\\x{2d}]/\n",
        );
        assert_eq!(to_lark(gbnf).unwrap(), want);
    }

    #[test]
    fn names_that_differ_stay_apart() {
        assert_ne!(rule_name("Ab"), rule_name("ab"));
        assert_ne!(rule_name("a_b"), rule_name("a-b"));
        assert_ne!(rule_name("_a"), rule_name("A"));
        assert_eq!(rule_name("json-value"), "g-json-value");
    }

    #[test]
    fn malformed_gbnf_is_named() {
        for (gbnf, says) in [
            ("a ::= \"x\"", "no root rule"),
            ("root ::= \"x", "not closed"),
            ("root ::= [a-", "not closed"),
            ("root ::= []", "empty character class"),
            ("root ::= [z-a]", "reversed"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= \"\\x4\"", "escape \\x needs 2 hex digits"),
            ("root ::= \"\\uD800\"", "not a character"),
            ("root ::= \"a\" {x}", "repetition"),
            ("root ::= \"a\"\nroot ::= \"b\"", "defined twice"),
            (
                "\"a\"\nroot ::= \"b\"",
                "expected a rule (name ::= ...), found string \"a\"",
            ),
            ("root ::= \"a\" : \"b\"", "unexpected character ':'"),
            ("root ::= \"a\" ; ", "unexpected character"),
        ] {
            let err = to_lark(gbnf).unwrap_err();
            assert!(err.contains(says), "{gbnf:?}: {err}");
        }
    }
}
