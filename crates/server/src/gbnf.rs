//! vLLM's `guided_grammar`: a grammar in llguidance's Lark syntax, or in llama.cpp's GBNF (rules
//! written `name ::= ...`, as vLLM's examples and xgrammar take them), which is rewritten into
//! Lark for llguidance.
//!
//! GBNF's rule bodies run until the next `name ::=` and may span lines; Lark's end at a newline,
//! its rule names are lowercase and its character classes are regexes. The rewrite puts each
//! rule on one line, renames every rule `g-<name>` (`root` is `start`'s one expansion), writes
//! strings in Lark's JSON form and classes and `.` as `/[...]/` regexes of `\x{..}` code points.
//!
//! GBNF matches characters; llguidance splits the output into lexemes, each taken whole and
//! greedily. So a rule made of characters alone (strings, classes and such rules, without
//! recursion) becomes a Lark terminal (`G-<NAME>`, one regex), as llguidance's own GBNF
//! converter does: `root ::= [a-z]* "ing"` takes "singing". Only where a recursive rule puts
//! lexemes side by side can the greedy lexer refuse a string GBNF takes (one lexeme that could
//! end early or run on into the next).

use std::collections::HashSet;

/// `text` as a Lark grammar: GBNF (a rule defined with `::=`) rewritten, Lark as given.
pub fn to_lark(text: &str) -> Result<String, String> {
    if !is_gbnf(text) {
        return Ok(text.to_string());
    }
    let tokens = lex(text)?;
    let mut rules: Vec<(String, Vec<Tok>)> = Vec::new();
    let mut defined = HashSet::new();
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
            if tokens[i] == Tok::Defines {
                return Err(format!(
                    "GBNF: rule {name}: a '::=' without a rule name before it"
                ));
            }
            body.push(tokens[i].clone());
            i += 1;
        }
        if !defined.insert(name.clone()) {
            return Err(format!("GBNF: rule {name} is defined twice"));
        }
        rules.push((name.clone(), body));
    }
    if !defined.contains("root") {
        return Err("GBNF: no root rule (root ::= ...)".into());
    }
    for (name, body) in &rules {
        let undefined = body.iter().find_map(|t| match t {
            Tok::Name(n) if !defined.contains(n) => Some(n),
            _ => None,
        });
        if let Some(n) = undefined {
            return Err(format!("GBNF: rule {name} refers to {n}, which is not defined"));
        }
    }
    // Rules of characters alone (no recursion) become Lark terminals, each one regex: GBNF
    // matches characters, and llguidance's lexer takes each lexeme whole, greedily.
    let mut terminal: HashSet<&str> = HashSet::new();
    loop {
        let before = terminal.len();
        for (name, body) in &rules {
            if body
                .iter()
                .all(|t| !matches!(t, Tok::Name(n) if !terminal.contains(n.as_str())))
            {
                terminal.insert(name);
            }
        }
        if terminal.len() == before {
            break;
        }
    }
    let name_of = |n: &str| match terminal.contains(n) {
        true => terminal_name(n),
        false => rule_name(n),
    };
    let mut out = format!("start: {}\n", name_of("root"));
    for (name, body) in &rules {
        let body = lark_body(body, &name_of).map_err(|e| format!("GBNF: rule {name}: {e}"))?;
        out.push_str(&format!("{}: {body}\n", name_of(name)));
    }
    Ok(out)
}

/// A rule's body in Lark, names by `name_of`. A repetition of a repeated atom is put in
/// parentheses (Lark takes one per atom); an empty alternative is the empty string.
fn lark_body(body: &[Tok], name_of: &dyn Fn(&str) -> String) -> Result<String, String> {
    let mut out: Vec<String> = Vec::new();
    // Where each open group starts; where the last atom (or closed group) starts; whether it
    // is repeated already; whether the current alternative has an atom.
    let mut opens = Vec::new();
    let mut atom: Option<usize> = None;
    let mut repeated = false;
    let mut filled = false;
    for t in body {
        match t {
            Tok::Punct(p) if p == "(" => {
                opens.push(out.len());
                out.push(p.clone());
                (atom, repeated, filled) = (None, false, false);
            }
            Tok::Punct(p) if p == ")" => {
                let open = opens.pop().ok_or("a ')' without its '('")?;
                if !filled {
                    out.push(EMPTY.into());
                }
                out.push(p.clone());
                (atom, repeated, filled) = (Some(open), false, true);
            }
            Tok::Punct(p) if p == "|" => {
                if !filled {
                    out.push(EMPTY.into());
                }
                out.push(p.clone());
                (atom, repeated, filled) = (None, false, false);
            }
            Tok::Punct(p) => {
                let start = atom.ok_or_else(|| format!("{p} repeats nothing"))?;
                if repeated {
                    out.insert(start, "(".into());
                    out.push(")".into());
                }
                out.push(p.clone());
                repeated = true;
            }
            t => {
                atom = Some(out.len());
                out.push(t.lark(name_of));
                (repeated, filled) = (false, true);
            }
        }
    }
    if !opens.is_empty() {
        return Err("a '(' without its ')'".into());
    }
    if !filled {
        out.push(EMPTY.into());
    }
    Ok(out.join(" "))
}

/// The empty string in Lark.
const EMPTY: &str = "\"\"";

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

/// GBNF rule `name` as a Lark terminal name (capitals only): `G-` and the name, each
/// lowercase letter in capitals, each capital after a `_`, each `_` doubled.
fn terminal_name(name: &str) -> String {
    let mut out = String::from("G-");
    for c in name.chars() {
        match c {
            'a'..='z' => out.push(c.to_ascii_uppercase()),
            'A'..='Z' => {
                out.push('_');
                out.push(c);
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

    /// The token in Lark, a rule's name by `name_of` (a body holds no `::=`: it is refused
    /// before).
    fn lark(&self, name_of: &dyn Fn(&str) -> String) -> String {
        match self {
            Tok::Name(n) => name_of(n),
            Tok::Defines => "::=".into(),
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
                out.push(Tok::Punct(repetition(&inner)?));
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

/// A repetition's braces (`inner` between them, spaces dropped) as Lark writes them: `{m}`,
/// `{m,}`, `{m,n}` or `{,n}`, with at least one repeat allowed and `m <= n`.
fn repetition(inner: &str) -> Result<String, String> {
    let bad = || {
        format!("GBNF: repetition {{{inner}}}: expected {{m}}, {{m,}}, {{m,n}} or {{,n}} allowing a repeat")
    };
    let num = |s: &str| -> Result<Option<u32>, String> {
        match s {
            "" => Ok(None),
            s if s.chars().all(|c| c.is_ascii_digit()) => s.parse().map(Some).map_err(|_| bad()),
            _ => Err(bad()),
        }
    };
    let (m, n) = match inner.split_once(',') {
        None => {
            let m = num(inner)?.ok_or_else(bad)?;
            (m, Some(m))
        }
        Some((a, b)) => (num(a)?.unwrap_or(0), num(b)?),
    };
    match n {
        Some(n) if n == 0 || n < m => Err(bad()),
        _ => Ok(format!("{{{inner}}}")),
    }
}

/// The escape at `chars[*i]` (a backslash), as llama.cpp reads it: `\x..`, `\u....`,
/// `\U........`, `\t \r \n \\ \" \[ \]`.
fn escape(chars: &[char], i: &mut usize) -> Result<char, String> {
    let hex = |i: &mut usize, n: usize| -> Result<char, String> {
        let letter = chars[*i + 1];
        let digits: String = chars.get(*i + 2..*i + 2 + n).unwrap_or_default().iter().collect();
        let code = u32::from_str_radix(&digits, 16)
            .ok()
            .filter(|_| digits.len() == n && digits.chars().all(|c| c.is_ascii_hexdigit()))
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
    use llguidance::api::TopLevelGrammar;

    /// Whether `grammar` (GBNF or Lark) takes `text` whole, read a byte at a time by llguidance.
    fn takes(grammar: &str, text: &str) -> bool {
        let env = llguidance::toktrie::ApproximateTokEnv::single_byte_env();
        let mut factory = llguidance::ParserFactory::new_simple(&env).unwrap();
        factory.quiet();
        let lark = to_lark(grammar).unwrap();
        let parser = factory
            .create_parser(TopLevelGrammar::from_lark(lark.clone()))
            .unwrap_or_else(|e| panic!("{e}\n{lark}"));
        let mut m = llguidance::Matcher::new(Ok(parser));
        let ids: Vec<u32> = text.bytes().map(u32::from).collect();
        m.try_consume_tokens(&ids).is_ok_and(|n| n == ids.len()) && m.is_accepting().unwrap_or(false)
    }

    #[test]
    fn lark_passes_through() {
        let lark = "start: \"a\" | b\nb: /[0-9]+/\n";
        assert_eq!(to_lark(lark).unwrap(), lark);
    }

    /// Rules of characters alone become terminals (capitals), recursive ones stay rules; each
    /// rule one line; comments dropped.
    #[test]
    fn gbnf_rules_become_one_line_each() {
        let gbnf = r#"
# a comment
root ::= greeting ( " " Name )? list   # trailing comment
greeting ::= "hi" |
   "hello\n"
Name ::= [A-Z] [a-z_]* "\"" .
list ::= "(" list ")" | greeting
"#;
        let want = concat!(
            "start: g-root\n",
            "g-root: G-GREETING ( \" \" G-_NAME ) ? g-list\n",
            "G-GREETING: \"hi\" | \"hello\\u000a\"\n",
            "G-_NAME: /[\\x{41}-\\x{5a}]/ /[\\x{61}-\\x{7a}\\x{5f}]/ * \"\\\"\" /(?s:.)/\n",
            "g-list: \"(\" g-list \")\" | G-GREETING\n",
        );
        assert_eq!(to_lark(gbnf).unwrap(), want);
    }

    /// What the rewritten grammars take, read by llguidance: GBNF's language, character by
    /// character where a rule is of characters alone.
    #[test]
    fn rewritten_grammars_take_what_gbnf_takes() {
        let json_ish =
            "root ::= value\nvalue ::= \"[\" ws ( value ( \",\" ws value )* )? \"]\" ws | num ws\n\
                        num ::= [0-9]+\nws ::= | \" \"";
        let cases: &[(&str, &[&str], &[&str])] = &[
            (
                r#"root ::= [a-z]* "ing""#,
                &["singing", "sing", "ing"],
                &["singin", "Sing", ""],
            ),
            (json_ish, &["[1, [22], []]", "7", "[ ]"], &["[1,,2]", "[", "[1]]"]),
            (r#"root ::= "ab"{2}?"#, &["", "abab"], &["ab", "ababab"]),
            (r#"root ::= "a" | "#, &["", "a"], &["aa"]),
            (r#"root ::= ( "a" | ) "b""#, &["b", "ab"], &["a"]),
            (
                r#"root ::= "\x41\u00e9" [^a-z]"#,
                &["Aé1", "AéZ", "Aé^"],
                &["Aéb", "Aé"],
            ),
            (r#"root ::= . "x""#, &["\nx", "ax", "éx"], &["x", "axx"]),
            (
                "a_b ::= \"1\"\njson-value ::= a_b \"2\"\nroot ::= json-value",
                &["12"],
                &["1", "2"],
            ),
            // (A rule made a terminal by one that comes later.)
            (
                "root ::= w \"ing\"\nw ::= [a-z]*",
                &["singing", "ing"],
                &["sing1"],
            ),
            (r#"root ::= "a"{,2} "b""#, &["b", "aab"], &["aaab"]),
            (r#"root ::= "a"{2,} "b""#, &["aab", "aaaab"], &["ab"]),
            (r#"root ::= [a-]+"#, &["a-a", "-"], &["b", ""]),
            ("root ::= \"x\" # no newline at the end", &["x"], &["x#"]),
            (r#"root ::= [\]\-\\]"#, &["]", "-", "\\"], &["a"]),
        ];
        for (grammar, yes, no) in cases {
            for text in *yes {
                assert!(
                    takes(grammar, text),
                    "{grammar:?} should take {text:?}:\n{}",
                    to_lark(grammar).unwrap()
                );
            }
            for text in *no {
                assert!(
                    !takes(grammar, text),
                    "{grammar:?} should not take {text:?}:\n{}",
                    to_lark(grammar).unwrap()
                );
            }
        }
    }

    #[test]
    fn names_that_differ_stay_apart() {
        for name in [rule_name, terminal_name] {
            assert_ne!(name("Ab"), name("ab"));
            assert_ne!(name("a_b"), name("a-b"));
            assert_ne!(name("_a"), name("A"));
        }
        assert_eq!(rule_name("json-value"), "g-json-value");
        assert_eq!(terminal_name("json-Value_1"), "G-JSON-_VALUE__1");
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
            ("root ::= \"\\x+1\"", "escape \\x needs 2 hex digits"),
            ("root ::= \"\\uD800\"", "not a character"),
            ("root ::= \"a\" {x}", "repetition {x}"),
            ("root ::= \"a\" {0}", "repetition {0}"),
            ("root ::= \"a\" {,0}", "repetition {,0}"),
            ("root ::= \"a\" {3,1}", "repetition {3,1}"),
            ("root ::= \"a\" {+1}", "repetition {+1}"),
            ("root ::= \"a\"\nroot ::= \"b\"", "defined twice"),
            (
                "\"a\"\nroot ::= \"b\"",
                "expected a rule (name ::= ...), found string \"a\"",
            ),
            ("root ::= \"a\" : \"b\"", "unexpected character ':'"),
            (
                "root ::= \"a\" ::= \"b\"",
                "rule root: a '::=' without a rule name",
            ),
            ("root ::= ::=", "without a rule name"),
            ("root ::= b", "rule root refers to b, which is not defined"),
            ("root ::= ( \"a\"", "rule root: a '(' without its ')'"),
            ("root ::= \"a\" )", "rule root: a ')' without its '('"),
            ("root ::= * \"a\"", "rule root: * repeats nothing"),
            ("root ::= \"a\" | + ", "+ repeats nothing"),
        ] {
            let err = to_lark(gbnf).unwrap_err();
            assert!(err.contains(says), "{gbnf:?}: {err}");
        }
    }
}
