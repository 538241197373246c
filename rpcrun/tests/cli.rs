//! The two binaries as a user first meets them: `--help` says what each one is.

use std::process::Command;

fn help(exe: &str) -> String {
    let out = Command::new(exe)
        .arg("--help")
        .output()
        .expect("the binary runs");
    assert!(out.status.success(), "{exe} --help: {:?}", out.status);
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// `rpctrace --help` began with the launcher's description (clap's bare `about` takes the
/// crate's, which is `rpcrun`'s), so a user read that `rpctrace` launches workers.
#[test]
fn each_binary_describes_itself() {
    let trace = help(env!("CARGO_BIN_EXE_rpctrace"));
    assert!(
        trace.starts_with("Merges trace parts and reports on a merged trace"),
        "{trace}"
    );
    let run = help(env!("CARGO_BIN_EXE_rpcrun"));
    assert!(
        run.starts_with("Launcher for groups of worker processes"),
        "{run}"
    );
}

/// A trace that is not there fails with a status and names the path.
#[test]
fn a_missing_trace_is_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_rpctrace"))
        .args(["report", "/nonexistent/job.json"])
        .output()
        .expect("the binary runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/job.json"), "{err}");
}
