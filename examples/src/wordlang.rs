//! The word-language dataset shipped in `data/wordlang` (built from Debian's word lists by
//! `data/prepare_wordlang.py`): lines of `word<TAB>language`, a fixed 80/20 split.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The languages, in label order.
pub const LANGS: [&str; 8] = [
    "american-english",
    "french",
    "ngerman",
    "spanish",
    "italian",
    "dutch",
    "polish",
    "swedish",
];

/// Where the dataset is: `$WORDLANG_DIR`, else the repository's `data/wordlang`.
pub fn data_dir() -> PathBuf {
    std::env::var_os("WORDLANG_DIR")
        .map(Into::into)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/wordlang"))
}

/// Reads `dir/name` as (word, label) pairs; a missing file or a bad line is an error naming
/// the file and the line.
pub fn load(dir: &Path, name: &str) -> Result<Vec<(String, usize)>> {
    let path = dir.join(name);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "cannot read the dataset at {} (rebuild it with data/prepare_wordlang.py, or point \
             WORDLANG_DIR at a copy)",
            path.display()
        )
    })?;
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            let (w, lang) = l.split_once('\t').with_context(|| {
                format!("{}:{}: expected `word<TAB>language`", path.display(), i + 1)
            })?;
            let y = LANGS.iter().position(|x| *x == lang).with_context(|| {
                format!("{}:{}: unknown language {lang:?}", path.display(), i + 1)
            })?;
            anyhow::ensure!(!w.is_empty(), "{}:{}: empty word", path.display(), i + 1);
            Ok((w.to_owned(), y))
        })
        .collect()
}
