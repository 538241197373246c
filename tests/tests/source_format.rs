//! Code that rustfmt gave up on, found from the sources (FMT-1). rustfmt leaves a statement
//! as it is written when it cannot format it (the arguments of `tracing`'s and `json!`'s
//! macros, `tokio::select!` arms, a line it cannot fit), and `cargo fmt --check` passes over
//! it. What it leaves behind is a line over the width every formatted line keeps (100
//! characters): the statement rustfmt could not format, or the string literal too long to fit
//! that made it give up on the whole statement. So no line of Rust in the workspace is longer,
//! comments aside.

use std::path::{Path, PathBuf};

/// rustfmt's `max_width` (its default; the workspace sets no other).
const MAX_WIDTH: usize = 100;

/// Where a line starts and ends, as a small lexer of Rust sees it.
#[derive(Clone, Copy, PartialEq, Debug)]
enum State {
    Code,
    /// Inside `"…"`.
    Str,
    /// Inside `r#…"…"#…` with this many hashes.
    Raw(usize),
    /// Inside `/* … */` at this depth.
    Block(usize),
}

/// One line, lexed: the state after it, its string literals' byte ranges and where a comment
/// to the end of the line starts.
struct Lexed {
    end: State,
    literals: Vec<(usize, usize)>,
    comment_at: Option<usize>,
}

fn lex(line: &str, start: State) -> Lexed {
    let b = line.as_bytes();
    let mut state = start;
    let mut literals = Vec::new();
    let mut lit_start = 0;
    let mut comment_at = None;
    let mut i = 0;
    while i < b.len() {
        match state {
            State::Code => {
                let rest = &line[i..];
                if rest.starts_with("//") {
                    comment_at = Some(i);
                    break;
                } else if rest.starts_with("/*") {
                    state = State::Block(1);
                    i += 2;
                    continue;
                } else if b[i] == b'"' {
                    state = State::Str;
                    lit_start = i;
                } else if let Some(h) = raw_start(rest) {
                    state = State::Raw(h);
                    lit_start = i;
                    i += h + 2;
                    continue;
                } else if b[i] == b'\'' {
                    // A char literal ('x', '\n', '"'), or a lifetime ('a).
                    if let Some(len) = char_literal(rest) {
                        i += len;
                        continue;
                    }
                }
            }
            State::Str => {
                if b[i] == b'\\' {
                    i += 2;
                    continue;
                }
                if b[i] == b'"' {
                    state = State::Code;
                    literals.push((lit_start, i + 1));
                }
            }
            State::Raw(h) => {
                let close = format!("\"{}", "#".repeat(h));
                if line[i..].starts_with(&close) {
                    state = State::Code;
                    literals.push((lit_start, i + close.len()));
                    i += close.len();
                    continue;
                }
            }
            State::Block(d) => {
                if line[i..].starts_with("*/") {
                    state = if d == 1 {
                        State::Code
                    } else {
                        State::Block(d - 1)
                    };
                    i += 2;
                    continue;
                } else if line[i..].starts_with("/*") {
                    state = State::Block(d + 1);
                    i += 2;
                    continue;
                }
            }
        }
        i += 1;
    }
    if matches!(state, State::Str | State::Raw(_)) {
        literals.push((lit_start, b.len()));
    }
    Lexed {
        end: state,
        literals,
        comment_at,
    }
}

/// The number of hashes of a raw string starting here (`r"`, `r#"`, `br#"`), if one does.
fn raw_start(s: &str) -> Option<usize> {
    let s = s.strip_prefix('b').unwrap_or(s);
    let s = s.strip_prefix('r')?;
    let hashes = s.bytes().take_while(|&c| c == b'#').count();
    (s.as_bytes().get(hashes) == Some(&b'"')).then_some(hashes)
}

/// The length of a char literal starting here, if one does (not a lifetime).
fn char_literal(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    if b.get(1) == Some(&b'\\') {
        return s[2..].find('\'').map(|j| j + 3);
    }
    let c = s[1..].chars().next()?;
    let after = 1 + c.len_utf8();
    (b.get(after) == Some(&b'\'')).then_some(after + 1)
}

/// Whether a line over the width is one rustfmt would keep as it is and go on formatting
/// around: a comment. (A string literal over the width makes rustfmt give up on its whole
/// statement, so a long literal is split with `\` continuations, each piece within the width.)
fn kept_by_rustfmt(line: &str, start: State, lexed: &Lexed) -> bool {
    match start {
        State::Block(_) => true,
        State::Code => lexed
            .comment_at
            .is_some_and(|c| line[..c].trim().is_empty()),
        State::Str | State::Raw(_) => false,
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("a directory of the workspace") {
        let p = e.expect("an entry").path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            if !(name.starts_with('.') || name == "target") {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// The lines over the width that rustfmt would not keep, as `path:line: length`.
fn overlong(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    files.sort();
    let mut found = Vec::new();
    for path in files {
        let source = std::fs::read_to_string(&path).expect("a readable source file");
        let mut state = State::Code;
        for (n, line) in source.lines().enumerate() {
            let lexed = lex(line, state);
            if line.chars().count() > MAX_WIDTH && !kept_by_rustfmt(line, state, &lexed) {
                let rel = path.strip_prefix(root).unwrap_or(&path);
                found.push(format!(
                    "{}:{}: {} characters",
                    rel.display(),
                    n + 1,
                    line.len()
                ));
            }
            state = lexed.end;
        }
    }
    found
}

/// FMT-1: no line of code is wider than rustfmt's width.
#[test]
fn no_code_that_rustfmt_gave_up_on() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root");
    let found = overlong(root);
    assert!(
        found.is_empty(),
        "{} lines are wider than {MAX_WIDTH} characters: rustfmt gave up on the statements \
         around them (a macro's arguments, a select! arm); format them by hand:\n{}",
        found.len(),
        found.join("\n")
    );
}

/// The check itself: what it lets through, and what it does not.
#[test]
fn the_check_tells_code_from_literals_and_comments() {
    let long = "x".repeat(120);
    let judge = |line: &str| {
        let l = lex(line, State::Code);
        line.chars().count() <= MAX_WIDTH || kept_by_rustfmt(line, State::Code, &l)
    };
    assert!(judge(&format!("    // {long}")));
    assert!(judge(&format!("    /// {long}")));
    assert!(!judge(&format!("    \"{long}\",")));
    assert!(!judge(&format!("    r#\"{long}\"#,")));
    assert!(!judge(&format!("    let x = 1; // {long}")));
    assert!(!judge(&format!("    tracing::warn!(a = 1, \"{long}\");")));
    assert!(!judge(&format!("    let {long} = 1;")));
    assert!(!judge(&format!("    let s = \"// {long}\";")));
    // A lifetime is not a char literal; a quote in a char literal opens no string.
    let l = lex("fn f<'a>(x: &'a str) -> char { '\"' }", State::Code);
    assert_eq!(l.end, State::Code);
    assert!(l.literals.is_empty());
    // Strings spanning lines.
    let l = lex("    let s = \"usage: a \\", State::Code);
    assert_eq!(l.end, State::Str);
    assert!(!kept_by_rustfmt(&long, State::Str, &lex(&long, State::Str)));
    assert!(kept_by_rustfmt(
        &long,
        State::Block(1),
        &lex(&long, State::Block(1))
    ));
}
