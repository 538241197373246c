//! The command line: the usage text, and the check that every argument is one it names.

use anyhow::{bail, Context, Result};

pub(crate) const USAGE: &str =
    "rpc-bench: benchmarks of rpc-core against raw TCP and each other on 127.0.0.1, in peer \
processes it starts itself; one JSON object per line.

usage: rpc-bench [all|latency|throughput|tensor|rref|allreduce|overhead|trace-overhead|soak|ddp] \
[--threads N] [--busy-poll-us N] [--no-shm] [--wire-protection P] [--heartbeat-ms N] [--calls N] \
[--world-sizes N,N] [--steps N] [--ring-threads N] [--variants V,V] [--interleave K]
  --threads N        runtime worker threads of every process (default 1: two processes
                     on a 2-core machine; 0: current-thread runtime)
  --busy-poll-us N   Config::busy_poll of every process, in microseconds (default: the
                     library's, 100; 0: off)
  --no-shm           bulk blobs stream over TCP instead of shared memory
  --wire-protection P  Config::wire_protection of every process: auto (default), mac,
                     encrypt, off (on loopback auto is off)
  --heartbeat-ms N   Config::heartbeat_interval of every process (0: no failure detector;
                     default: the library's, 250)
  --calls N          calls the soak makes (default 1000000; a memory slope needs 30000)
  overhead           the cost of the wire protection, the failure detector and the trace
  trace-overhead     the cost of the job's trace alone (off and on alternated, 6 rounds)
  soak               mixed calls among three processes: memory slope and references
  ddp                the data-parallel step (local, no_comm, after, overlap, bf16) on the anchors'
                     reference model, with --world-sizes (default 2,4), --steps (30) and
                     --ring-threads (the ring's threads per operation; default: the group's)
                     and --variants (default local,no_comm,after,overlap,bf16,all_reduce)
                     and --interleave K (the step variants, local too, alternated in blocks
                     of K steps in one group: comparisons that hold on a machine whose speed
                     moves)
Prints one JSON object per line.";

/// The flags that take a value, and those that stand alone.
const VALUE_FLAGS: [&str; 10] = [
    "--threads",
    "--busy-poll-us",
    "--wire-protection",
    "--heartbeat-ms",
    "--calls",
    "--world-sizes",
    "--steps",
    "--ring-threads",
    "--variants",
    "--interleave",
];
const BARE_FLAGS: [&str; 2] = ["--no-shm", "--trace"];

/// Refuses what the usage does not name (a mistyped flag would otherwise run the default
/// benchmark for minutes and report it as asked for).
pub(crate) fn check_flags(flags: &[String]) -> Result<()> {
    let mut it = flags.iter();
    while let Some(f) = it.next() {
        if VALUE_FLAGS.contains(&f.as_str()) {
            it.next().with_context(|| format!("{f} needs a value"))?;
        } else if !BARE_FLAGS.contains(&f.as_str()) {
            bail!("unknown argument {f:?}\n{USAGE}");
        }
    }
    Ok(())
}
