//! A mistyped flag is refused at once, naming it, instead of running the default benchmark
//! for minutes and reporting it as the one asked for; `--help` anywhere prints the usage.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs rpc-bench with `args`, killing it after 20 s: (exit success, stdout, stderr).
fn bench(args: &[&str]) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rpc-bench"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts rpc-bench");
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("waits").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("rpc-bench {args:?} still ran after 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    (out.status.success(), text(out.stdout), text(out.stderr))
}

#[test]
fn a_mistyped_flag_is_refused_naming_it() {
    let (ok, _, err) = bench(&["ddp", "--step", "3"]);
    assert!(!ok && err.contains("unknown argument \"--step\""), "{err}");
    let (ok, _, err) = bench(&["ddp", "--world-sizes"]);
    assert!(!ok && err.contains("--world-sizes needs a value"), "{err}");
    let (ok, out, _) = bench(&["ddp", "--steps", "3", "--help"]);
    assert!(ok && out.contains("usage: rpc-bench"), "{out}");
}

/// A value that measures nothing is refused before the first figure, naming the flag. Before,
/// `--steps 0` panicked (the median of no steps) after building the model, and
/// `--world-sizes 0` measured the one-process figure first, then failed creating the group.
#[test]
fn a_value_that_measures_nothing_is_refused_before_the_first_figure() {
    for (args, says) in [
        (&["ddp", "--steps", "0"][..], "--steps must be at least 1"),
        (
            &["ddp", "--world-sizes", "2,0"],
            "--world-sizes: a group of 0",
        ),
        (&["soak", "--calls", "0"], "--calls must be at least 1"),
        (
            &["ddp", "--interleave", "0"],
            "--interleave takes a block of 1 step or more",
        ),
        (
            &["ddp", "--interleave", "five"],
            "--interleave takes a number of steps",
        ),
    ] {
        let (ok, out, err) = bench(args);
        assert!(!ok && err.contains(says), "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: measured first: {out}");
    }
}
