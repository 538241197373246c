//! The documentation, checked from the files (DOC-1..4):
//!
//! - DOC-1: every page with Rust code (the README, `docs/*.md`, the examples' READMEs) is
//!   compiled as doc tests (`tests/src/lib.rs` includes it), so its code cannot rot.
//! - DOC-2: the pages say what holds now: no run markers (`(s8)`), no narrative of sessions or
//!   runs ("this session", "the previous run"), no commit ranges. History is `CHANGELOG.md`'s.
//! - DOC-3: every relative link leads to a file that exists.
//! - DOC-4: the README stays a short entry (at most 15 KiB).

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
}

/// The pages a reader meets: the README, `docs/*.md`, every README under `examples/`.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md")];
    for dir in ["docs", "examples"] {
        let mut stack = vec![root().join(dir)];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).expect("a docs directory") {
                let p = e.expect("an entry").path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "md") {
                    out.push(p);
                }
            }
        }
    }
    out.sort();
    out
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// DOC-1.
#[test]
fn every_page_with_rust_code_is_compiled() {
    let lib = std::fs::read_to_string(root().join("tests/src/lib.rs")).expect("tests/src/lib.rs");
    let mut missing = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a readable page");
        if !text.contains("```rust") {
            continue;
        }
        let from_lib = format!("../../{}", rel(&page));
        let included = format!("include_str!(\"{from_lib}\")");
        if !lib.contains(&included) {
            missing.push(rel(&page));
        }
    }
    assert!(
        missing.is_empty(),
        "pages with Rust code that the doc tests do not compile (add #[doc = \
         include_str!(...)] to tests/src/lib.rs's doc_pages): {missing:?}"
    );
}

/// What marks a narrative of runs rather than what holds now.
const RUN_MARKERS: &[&str] = &[
    "(s8)",
    "*(s",
    "this session",
    "the session",
    "previous session",
    "earlier session",
    "sessions",
    "the previous run",
    "an earlier run",
    "earlier runs",
    "the latest run",
    "in the latest",
    "earlier builds",
    "the day before",
];

/// DOC-2.
#[test]
fn pages_say_what_holds_now() {
    let mut found = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a readable page");
        for (n, line) in text.lines().enumerate() {
            let lower = line.to_lowercase();
            for m in RUN_MARKERS {
                if lower.contains(m) {
                    found.push(format!("{}:{}: {m:?}", rel(&page), n + 1));
                }
            }
            if let Some(range) = commit_range(line) {
                found.push(format!("{}:{}: commit range {range}", rel(&page), n + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "history in the docs (it belongs in CHANGELOG.md):\n{}",
        found.join("\n")
    );
}

/// A commit range such as `a19fb35..b2ba354` or `a19fb35 to b2ba354`.
fn commit_range(line: &str) -> Option<String> {
    let words: Vec<&str> = line
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '.'))
        .filter(|w| !w.is_empty())
        .collect();
    let is_hash = |w: &str| {
        (7..=40).contains(&w.len())
            && w.chars().all(|c| c.is_ascii_hexdigit())
            && w.chars().any(|c| c.is_ascii_alphabetic())
            && w.chars().any(|c| c.is_ascii_digit())
    };
    for w in &words {
        if let Some((a, b)) = w.split_once("..") {
            if is_hash(a) && (is_hash(b) || b == "HEAD") {
                return Some(w.to_string());
            }
        }
    }
    words
        .windows(3)
        .find(|t| is_hash(t[0]) && t[1] == "to" && is_hash(t[2]))
        .map(|t| t.join(" "))
}

/// DOC-3.
#[test]
fn relative_links_lead_somewhere() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).expect("a readable page");
        let mut rest = text.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            let path = target.split('#').next().unwrap_or("");
            if path.is_empty() || path.contains("://") || path.starts_with("mailto:") {
                continue;
            }
            let dir = page.parent().expect("a page's directory");
            if !dir.join(path).exists() {
                broken.push(format!("{}: {target}", rel(&page)));
            }
        }
    }
    assert!(broken.is_empty(), "links to nothing: {broken:?}");
}

/// DOC-4.
#[test]
fn the_readme_is_short() {
    let len = std::fs::metadata(root().join("README.md"))
        .expect("README.md")
        .len();
    assert!(
        len <= 15 * 1024,
        "README.md is {len} bytes; keep it an entry (at most 15 KiB) and move detail to docs/"
    );
}

/// The checks themselves.
#[test]
fn the_checks_tell_history_from_facts() {
    assert_eq!(
        commit_range("built from a19fb35 to b2ba354").as_deref(),
        Some("a19fb35 to b2ba354")
    );
    assert_eq!(
        commit_range("(what landed: bec5a30..HEAD)").as_deref(),
        Some("bec5a30..HEAD")
    );
    assert_eq!(
        commit_range("(9c08e16..1b2c3d4)").as_deref(),
        Some("9c08e16..1b2c3d4")
    );
    assert_eq!(commit_range("from 1,000 to 2,000 steps"), None);
    assert_eq!(commit_range("measured 2026-11-24 at 6120b6b"), None);
}
