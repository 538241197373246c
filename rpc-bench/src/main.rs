//! `rpc-bench [all|latency|throughput|tensor|rref|allreduce|overhead|soak] [--threads N]
//! [--busy-poll-us N] [--no-shm] [--wire-protection auto|mac|encrypt|off] [--heartbeat-ms N]
//! [--calls N]`
//!
//! Starts a peer process (this binary, `peer` subcommand) on 127.0.0.1, forms a two-worker
//! group with it, and prints one JSON object per line: `metric`, `median` and, where they
//! apply, `p99`, `calls_per_s`, `effective_GBps` (= 2 × bytes / round trip). Raw-TCP baselines
//! (a 64-byte ping-pong and one-stream bandwidth, both to the same peer process) are measured
//! in the same run, so the ratios the targets speak of come from one machine state. The
//! all-reduce benchmark (`allreduce`, also the end of `all`) starts groups of 2 and 4
//! processes and reports `busbw_GBps` beside one-stream TCP measured in the same run.
//! `--no-shm` makes every process stream bulk blobs over TCP instead of shared memory.
//!
//! `overhead` measures what the safety machinery costs, each variant in a fresh pair of
//! processes, variants alternated over rounds: the wire protection (`off`, `mac`, `encrypt`,
//! forced on loopback, bulk blobs over TCP) and the failure detector (off, on at its default
//! interval; latency, throughput, and the CPU both processes spend while idle). It ends with
//! one `*_cost` line per variant: its medians as ratios to the baseline's. It measures the
//! job's trace too (off, on: latency and throughput); `trace-overhead` measures only that.
//!
//! `soak` runs a million mixed calls (`--calls`) among three processes and watches their
//! memory and their remote references (see `soak.rs`). `ddp [--world-sizes 2,4] [--steps N]`
//! times the data-parallel step on the anchors' reference model (see `ddp.rs`). `nccl` (built
//! with `--features cuda`, two GPUs or more) times NCCL's all-reduce against the ring's.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rpc_core::{
    remote, Agent, Blob, BoxError, CallContext, Config, Registry, RendezvousServer, Secret,
    Transport, WireProtection,
};
use serde_json::json;

mod allreduce;
mod calls;
mod ddp;
#[cfg(feature = "cuda")]
mod nccl;
mod overhead;
mod rrefs;
mod soak;
mod usage;
mod variant;

use allreduce::{allreduce_bench, allreduce_loop};
use calls::{echo_bench, latency, raw_stream, throughput};
use overhead::overhead;
use rrefs::rref_metrics;
use usage::{check_flags, USAGE};
use variant::{bulk_path, config, set_variant, shared_flags, Variant, BUSY_POLL_US};

/// Does nothing.
#[remote]
async fn noop(_ctx: CallContext) -> Result<(), BoxError> {
    Ok(())
}

/// Returns its argument.
#[remote]
async fn echo(_ctx: CallContext, data: Blob) -> Result<Blob, BoxError> {
    Ok(data)
}

/// Peak resident set size of this process, in MB.
#[remote]
async fn peak_rss(_ctx: CallContext) -> Result<f64, BoxError> {
    Ok(peak_rss_mb())
}

/// CPU time (user and system) this process has used, in seconds.
#[remote]
async fn cpu_seconds(_ctx: CallContext) -> Result<f64, BoxError> {
    Ok(cpu_seconds_here())
}

fn cpu_seconds_here() -> f64 {
    // SAFETY: getrusage(2) fills the struct it is given; zeroed is a valid initial value.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

/// How many raw echo connections the peer serves.
const RAW_ECHO_CONNECTIONS: usize = 3;

/// The busy-poll window of this run (`--busy-poll-us`).
fn busy_poll() -> Duration {
    Duration::from_micros(BUSY_POLL_US.get().copied().unwrap_or(0))
}

/// Reads `buf` whole: first without blocking for up to `poll` (giving way to other threads
/// between tries, as the framework's waits do with `Config::busy_poll`), then blocking.
fn read_polled(s: &mut TcpStream, buf: &mut [u8], poll: Duration) -> std::io::Result<()> {
    use rustix::io::Errno;
    let mut got = 0;
    let until = Instant::now() + poll;
    while got < buf.len() && !poll.is_zero() {
        match rustix::net::recv(&*s, &mut buf[got..], rustix::net::RecvFlags::DONTWAIT) {
            Ok((0, _)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok((k, _)) => got += k,
            Err(Errno::AGAIN | Errno::INTR) if Instant::now() < until => std::thread::yield_now(),
            Err(Errno::AGAIN | Errno::INTR) => break,
            Err(e) => return Err(e.into()),
        }
    }
    s.read_exact(&mut buf[got..])
}

/// A raw 64-byte ping-pong connection to the peer's echo server; `polled`: both ends poll
/// the socket for `busy_poll()` before blocking (the same waiting as the framework's).
struct RawConn {
    s: TcpStream,
    poll: Duration,
    buf: [u8; 64],
}

impl RawConn {
    fn connect(port: u16, polled: bool) -> Result<Self> {
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_nodelay(true)?;
        s.write_all(&[u8::from(polled)])?;
        let poll = if polled { busy_poll() } else { Duration::ZERO };
        Ok(Self {
            s,
            poll,
            buf: [7; 64],
        })
    }

    /// One round trip, in microseconds.
    fn ping(&mut self) -> Result<f64> {
        let t = Instant::now();
        self.s.write_all(&self.buf)?;
        read_polled(&mut self.s, &mut self.buf, self.poll)?;
        Ok(t.elapsed().as_secs_f64() * 1e6)
    }
}

/// Starts raw TCP echo and sink servers in this process; returns their ports.
#[remote]
async fn raw_servers(_ctx: CallContext) -> Result<(u16, u16), BoxError> {
    let echo_l = TcpListener::bind("127.0.0.1:0")?;
    let sink = TcpListener::bind("127.0.0.1:0")?;
    let ports = (echo_l.local_addr()?.port(), sink.local_addr()?.port());
    // One connection per section that measures a raw baseline (latency, RRef), each served
    // on a thread of its own; the process's exit ends whatever is left.
    std::thread::spawn(move || {
        for _ in 0..RAW_ECHO_CONNECTIONS {
            let Ok((mut s, _)) = echo_l.accept() else {
                return;
            };
            std::thread::spawn(move || {
                let _ = s.set_nodelay(true);
                // The first byte says whether this end polls too.
                let mut mode = [0u8; 1];
                if s.read_exact(&mut mode).is_err() {
                    return;
                }
                let poll = if mode[0] == 1 {
                    busy_poll()
                } else {
                    Duration::ZERO
                };
                let mut buf = [0u8; 64];
                while read_polled(&mut s, &mut buf, poll).is_ok() && s.write_all(&buf).is_ok() {}
            });
        }
    });
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = sink.accept() {
            let mut len = [0u8; 8];
            let mut buf = vec![0u8; 1 << 20];
            while s.read_exact(&mut len).is_ok() {
                let mut left = u64::from_le_bytes(len) as usize;
                while left > 0 {
                    let n = match s.read(&mut buf[..left.min(1 << 20)]) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    left -= n;
                }
                if s.write_all(&[1]).is_err() {
                    return;
                }
            }
        }
    });
    Ok(ports)
}

/// A small remote object (PyTorch's benchmark uses the same shape).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Counter {
    value: i64,
}

/// Constructor of a `Counter`.
#[remote]
async fn new_counter(_ctx: CallContext, start: i64) -> Result<Counter, BoxError> {
    Ok(Counter { value: start })
}

/// Method: adds `by`, returns the new value.
#[remote]
async fn incr(_ctx: CallContext, this: rref::RRef<Counter>, by: i64) -> Result<i64, BoxError> {
    let v = this.local_value().await?;
    let mut c = v.lock().await;
    c.value += by;
    Ok(c.value)
}

fn registry() -> Registry {
    Registry::builder()
        .register(noop)
        .and_then(|r| r.register(echo))
        .and_then(|r| r.register(peak_rss))
        .and_then(|r| r.register(cpu_seconds))
        .and_then(|r| r.register(raw_servers))
        .and_then(|r| r.register(new_counter))
        .and_then(|r| r.register(incr))
        .and_then(soak::register)
        .and_then(rref::install)
        .and_then(collectives::install)
        .expect("distinct names")
        .build()
}

/// The sizes `fields` of `/proc/self/status` names (`VmRSS`, `VmHWM`, ...), in MB; NaN for a
/// field it lacks.
fn status_mb<const N: usize>(fields: [&str; N]) -> [f64; N] {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    fields.map(|name| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    })
}

/// Peak resident set size of this process, in MB.
fn peak_rss_mb() -> f64 {
    let [hwm] = status_mb(["VmHWM"]);
    hwm
}

fn runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    let rt = if threads == 0 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()?
    };
    Ok(rt)
}

struct Stats {
    median: f64,
    p99: f64,
}

fn stats(mut xs: Vec<f64>) -> Stats {
    xs.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize];
    Stats {
        median: at(0.5),
        p99: at(0.99),
    }
}

fn emit(v: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

/// Kills the peer if the driver fails half way.
struct PeerGuard(Child);
impl Drop for PeerGuard {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

fn main() -> Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("all");
    if matches!(mode, "-h" | "--help" | "help") || args.iter().any(|a| a == "--help") {
        println!("{USAGE}");
        return Ok(());
    }
    if !mode.ends_with("-rank") && mode != "peer" {
        check_flags(&args[1.min(args.len())..])?;
    }
    let threads = match args.iter().position(|a| a == "--threads") {
        Some(i) => args
            .get(i + 1)
            .context("--threads needs a value")?
            .parse()?,
        // One runtime thread per process: the benchmark runs two processes (or four) on a
        // 2-core machine, and a second worker thread per process only adds wake-ups between
        // threads (measured: 148k vs 232k calls/s, rpc_async 88 vs 32 µs, in one run).
        None => 1,
    };
    let busy: u64 = match args.iter().position(|a| a == "--busy-poll-us") {
        Some(i) => args
            .get(i + 1)
            .context("--busy-poll-us needs a value")?
            .parse()?,
        // The library's default unless asked.
        None => Config::new().busy_poll.as_micros() as u64,
    };
    let _ = BUSY_POLL_US.set(busy);
    let value = |flag: &str| -> Result<Option<&String>> {
        match args.iter().position(|a| a == flag) {
            Some(i) => Ok(Some(
                args.get(i + 1)
                    .with_context(|| format!("{flag} needs a value"))?,
            )),
            None => Ok(None),
        }
    };
    set_variant(Variant {
        no_shm: args.iter().any(|a| a == "--no-shm"),
        protection: value("--wire-protection")?
            .map(|p| p.parse::<WireProtection>().map_err(anyhow::Error::msg))
            .transpose()?,
        heartbeat_ms: value("--heartbeat-ms")?.map(|v| v.parse()).transpose()?,
        trace: args.iter().any(|a| a == "--trace"),
    });
    match mode {
        "peer" => {
            let rendezvous = args.get(1).context("peer needs the rendezvous address")?;
            let rt = runtime(threads)?;
            rt.block_on(async {
                let agent = rpc_core::init(
                    config(1, rendezvous, Secret::from_env()?.context("no secret")?),
                    registry(),
                )
                .await?;
                let report = agent.shutdown().await;
                if !report.is_clean() {
                    bail!("peer shutdown not clean: {report:?}");
                }
                Ok(())
            })
        }
        "allreduce-rank" => {
            // One member of an all-reduce benchmark group (started by `allreduce`).
            let n: u32 = args.get(1).context("world size")?.parse()?;
            let rank: u32 = args.get(2).context("rank")?.parse()?;
            let rendezvous = args.get(3).context("rendezvous address")?;
            let rt = runtime(threads)?;
            rt.block_on(async {
                let cfg = config(rank, rendezvous, Secret::from_env()?.context("no secret")?)
                    .with_world_size(n)
                    .with_name(format!("rank{rank}"));
                let agent = rpc_core::init(cfg, registry()).await?;
                allreduce_loop(&agent).await?;
                agent.shutdown().await;
                Ok(())
            })
        }
        "allreduce" => {
            for n in [2u32, 4] {
                allreduce_bench(n, threads)?;
            }
            Ok(())
        }
        "all" => {
            drive(mode, threads)?;
            for n in [2u32, 4] {
                allreduce_bench(n, threads)?;
            }
            Ok(())
        }
        "latency" | "throughput" | "tensor" | "rref" => drive(mode, threads),
        #[cfg(feature = "cuda")]
        "nccl" => nccl::nccl_bench(),
        "overhead" => overhead(threads, false),
        "trace-overhead" => overhead(threads, true),
        "ddp" => {
            // One compute thread per process, like the anchor (set before any thread exists),
            // and freed tensors' memory kept for the next step (ALLOC-1), as training programs
            // built on the crates do.
            std::env::set_var("RAYON_NUM_THREADS", "1");
            autograd_dist::retain_freed_memory();
            let steps: usize = value("--steps")?
                .map(|v| v.parse())
                .transpose()?
                .unwrap_or(30);
            anyhow::ensure!(steps >= 1, "--steps must be at least 1");
            let ring: Option<usize> = value("--ring-threads")?.map(|v| v.parse()).transpose()?;
            let variants = value("--variants")?.map_or(ddp::ALL_VARIANTS, |v| v.as_str());
            let interleave: Option<usize> = value("--interleave")?
                .map(|v| v.parse().context("--interleave takes a number of steps"))
                .transpose()?;
            anyhow::ensure!(
                interleave != Some(0),
                "--interleave takes a block of 1 step or more"
            );
            // Every flag checked before the first figure (a run takes minutes).
            let world_sizes = ddp::world_sizes(value("--world-sizes")?)?;
            let rt = runtime(threads)?;
            if ddp::wants_local(variants)? && interleave.is_none() {
                emit(rt.block_on(ddp::local(steps))?);
            }
            for n in world_sizes {
                let (agent, _peers) = group(&rt, threads, n, "rank0", |rank, addr| {
                    vec![
                        "ddp-rank".into(),
                        n.to_string(),
                        rank.to_string(),
                        addr.into(),
                        steps.to_string(),
                        ring.map_or("auto".into(), |k| k.to_string()),
                        variants.into(),
                        interleave.map_or("none".into(), |k| k.to_string()),
                    ]
                })?;
                let (a, list) = (agent.clone(), variants.to_string());
                let lines = rt.block_on(rt.spawn(async move {
                    ddp::rank_main(&a, steps, ring, &list, interleave).await
                }))??;
                lines.into_iter().for_each(emit);
                rt.block_on(agent.shutdown());
            }
            Ok(())
        }
        "ddp-rank" => {
            // One member of a `ddp` group (started by `ddp`).
            std::env::set_var("RAYON_NUM_THREADS", "1");
            autograd_dist::retain_freed_memory();
            let n: u32 = args.get(1).context("world size")?.parse()?;
            let rank: u32 = args.get(2).context("rank")?.parse()?;
            let rendezvous = args.get(3).context("rendezvous address")?;
            let steps: usize = args.get(4).context("steps")?.parse()?;
            let ring = args.get(5).and_then(|k| k.parse().ok());
            let variants = args.get(6).context("variants")?;
            let interleave = args.get(7).and_then(|k| k.parse().ok());
            let rt = runtime(threads)?;
            rt.block_on(async {
                let cfg = config(rank, rendezvous, Secret::from_env()?.context("no secret")?)
                    .with_world_size(n)
                    .with_name(format!("rank{rank}"));
                let agent = rpc_core::init(cfg, registry()).await?;
                ddp::rank_main(&agent, steps, ring, variants, interleave).await?;
                agent.wait_for_group().await;
                Ok(())
            })
        }
        "soak" => {
            let calls = value("--calls")?.map(|v| v.parse()).transpose()?;
            let calls = calls.unwrap_or(1_000_000);
            anyhow::ensure!(calls >= 1, "--calls must be at least 1");
            soak_group(threads, calls)
        }
        "soak-rank" => {
            // A member of the soak's group (started by `soak`): serves until rank 0 ends it.
            let rank: u32 = args.get(1).context("rank")?.parse()?;
            let rendezvous = args.get(2).context("rendezvous address")?;
            let rt = runtime(threads)?;
            rt.block_on(async {
                let cfg = config(rank, rendezvous, Secret::from_env()?.context("no secret")?)
                    .with_world_size(3)
                    .with_name(format!("soak{rank}"));
                let agent = rpc_core::init(cfg, registry()).await?;
                soak::serve(&agent).await;
                let report = agent.shutdown().await;
                if !report.is_clean() {
                    bail!("soak{rank} shutdown not clean: {report:?}");
                }
                Ok(())
            })
        }
        other => bail!("unknown mode {other:?}\n{USAGE}"),
    }
}

/// Forms a group of this process (rank 0, on `rt`) and a peer process it starts, both
/// configured with the current [`Variant`].
fn pair(rt: &tokio::runtime::Runtime, threads: usize) -> Result<(Agent, PeerGuard)> {
    let secret = Secret::generate();
    let server = rt.block_on(RendezvousServer::start(
        &Transport::Tcp,
        "127.0.0.1:0",
        secret.clone(),
        2,
        Duration::from_secs(30),
    ))?;
    let addr = server.local_addr().to_owned();
    let peer = Command::new(std::env::current_exe()?)
        .args(["peer", &addr])
        .args(shared_flags(threads))
        .env(
            rpc_core::SECRET_ENV,
            secret.as_str().context("generated secrets are text")?,
        )
        .stdin(Stdio::null())
        .spawn()
        .context("starting the peer process")?;
    let guard = PeerGuard(peer);
    let agent = rt.block_on(rpc_core::init(config(0, &addr, secret), registry()))?;
    rt.block_on(server.finish(Duration::from_secs(5)));
    Ok((agent, guard))
}

fn drive(mode: &str, threads: usize) -> Result<()> {
    let rt = runtime(threads)?;
    let (agent, _guard) = pair(&rt, threads)?;
    let runtime_name = if threads == 0 {
        "current_thread".to_owned()
    } else {
        format!("multi_thread({threads})")
    };
    let ctx = json!({
        "runtime": runtime_name,
        "transport": "tcp",
        "bulk": bulk_path(),
        "busy_poll_us": BUSY_POLL_US.get().copied().unwrap_or(0),
    });
    let tag = |mut v: serde_json::Value| {
        if let (Some(o), Some(c)) = (v.as_object_mut(), ctx.as_object()) {
            for (k, x) in c {
                o.insert(k.clone(), x.clone());
            }
        }
        v
    };
    let (echo_port, sink_port) = rt.block_on(agent.rpc_async(1u32, raw_servers, ()))?;
    if mode == "all" || mode == "latency" {
        for v in latency(&rt, &agent, echo_port, threads > 0)? {
            emit(tag(v));
        }
    }
    if mode == "all" || mode == "throughput" {
        let a = agent.clone();
        emit(tag(
            rt.block_on(rt.spawn(async move { throughput(&a).await }))??
        ));
    }
    if mode == "all" || mode == "rref" {
        for v in rref_metrics(&rt, &agent, echo_port)? {
            emit(tag(v));
        }
    }
    // Footprint of the RPC machinery itself, before any bulk payload is held.
    let rss = |phase: &str| -> Result<()> {
        let peer = rt.block_on(agent.rpc_async(1u32, peak_rss, ()))?;
        for (process, median) in [("bench", peak_rss_mb()), ("peer", peer)] {
            emit(tag(json!({
                "metric": "peak_rss_mb",
                "phase": phase,
                "process": process,
                "median": median,
            })));
        }
        Ok(())
    };
    rss("control")?;
    if mode == "all" || mode == "tensor" {
        emit(tag(raw_stream(sink_port)?));
        for (name, bytes, iters) in [
            ("echo_1KiB_rtt_us", 1usize << 10, 2000),
            ("echo_1MiB_rtt_us", 1 << 20, 200),
            ("echo_64MiB_rtt_us", 64 << 20, 12),
        ] {
            let a = agent.clone();
            emit(tag(rt.block_on(rt.spawn(async move {
                echo_bench(&a, name, bytes, iters).await
            }))??));
        }
    }
    if mode == "all" || mode == "tensor" {
        // Includes the payloads themselves (the bench holds a 64 MiB argument, a 64 MiB reply
        // and a 64 MiB raw-stream buffer; the peer one 64 MiB blob).
        rss("after_64MiB_echo")?;
    }
    let report = rt.block_on(agent.shutdown());
    if !report.is_clean() {
        bail!("shutdown not clean: {report:?}");
    }
    Ok(())
}

/// Forms a group of `n`: this process (rank 0, named `name`, on `rt`) and `n - 1` processes
/// of this binary it starts, rank `r` with the arguments `args(r, rendezvous address)`; all
/// configured with the current [`Variant`].
fn group(
    rt: &tokio::runtime::Runtime,
    threads: usize,
    n: u32,
    name: &str,
    args: impl Fn(u32, &str) -> Vec<String>,
) -> Result<(Agent, Vec<PeerGuard>)> {
    let secret = Secret::generate();
    let server = rt.block_on(RendezvousServer::start(
        &Transport::Tcp,
        "127.0.0.1:0",
        secret.clone(),
        n,
        Duration::from_secs(30),
    ))?;
    let addr = server.local_addr().to_owned();
    let mut peers = Vec::new();
    for rank in 1..n {
        let child = Command::new(std::env::current_exe()?)
            .args(args(rank, &addr))
            .args(shared_flags(threads))
            .env(
                rpc_core::SECRET_ENV,
                secret.as_str().context("text secret")?,
            )
            .stdin(Stdio::null())
            .spawn()?;
        peers.push(PeerGuard(child));
    }
    let agent = rt.block_on(rpc_core::init(
        config(0, &addr, secret).with_world_size(n).with_name(name),
        registry(),
    ))?;
    rt.block_on(server.finish(Duration::from_secs(5)));
    Ok((agent, peers))
}

/// `soak`: rank 0 of a group of three processes drives the soak.
fn soak_group(threads: usize, calls: u64) -> Result<()> {
    let rt = runtime(threads)?;
    let (agent, peers) = group(&rt, threads, 3, "bench", |rank, addr| {
        vec!["soak-rank".into(), rank.to_string(), addr.into()]
    })?;
    let a = agent.clone();
    let run = rt.block_on(rt.spawn(soak::drive(a, calls)));
    let report = rt.block_on(agent.shutdown());
    run??;
    if !report.is_clean() {
        bail!("shutdown not clean: {report:?}");
    }
    for mut p in peers {
        let status = p.0.wait()?;
        if !status.success() {
            bail!("a soak peer exited with {status}");
        }
    }
    Ok(())
}
