//! Writes each fuzz target's seed inputs into `<dir>/<target>/seed-<n>` (the directory is the
//! first argument, `corpus` by default), where `cargo fuzz run <target>` starts from.

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "corpus".into()));
    let mut all: Vec<(&str, Vec<Vec<u8>>)> = rpc_core::fuzz::targets()
        .into_iter()
        .map(|(name, _, seeds)| (name, seeds))
        .collect();
    all.push(("tensor", autograd_dist::fuzz::seeds()));
    for (name, seeds) in all {
        let d = dir.join(name);
        std::fs::create_dir_all(&d)?;
        for (i, s) in seeds.iter().enumerate() {
            std::fs::write(d.join(format!("seed-{i}")), s)?;
        }
        println!("{name}: {} seeds", seeds.len());
    }
    Ok(())
}
