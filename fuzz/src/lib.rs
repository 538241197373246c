//! What the fuzz targets share: each seeds its own corpus directory (the first argument
//! libFuzzer is given that is not a flag) with well-formed inputs when that directory is
//! empty or missing, so `cargo fuzz run <target>` starts from inputs that reach past the
//! first checks.

use std::path::PathBuf;

/// The seeds of the target `name`.
fn seeds(name: &str) -> Vec<Vec<u8>> {
    #[cfg(feature = "tensor")]
    if name == "tensor" {
        return autograd_dist::fuzz::seeds();
    }
    rpc_core::fuzz::targets()
        .into_iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, _, seeds)| seeds)
        .unwrap_or_else(|| panic!("no fuzz target named {name}"))
}

/// Writes `name`'s seeds into the corpus directory this run was given, if it has none yet.
pub fn seed_corpus(name: &str) {
    let Some(dir) = std::env::args().skip(1).find(|a| !a.starts_with('-')) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let empty = std::fs::read_dir(&dir).map_or(true, |mut d| d.next().is_none());
    if !empty {
        return;
    }
    std::fs::create_dir_all(&dir).expect("the corpus directory can be made");
    for (i, s) in seeds(name).iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i}")), s).expect("a seed can be written");
    }
}
