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
//! times the data-parallel step on the anchors' reference model (see `ddp.rs`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use rpc_core::{
    remote, Agent, Blob, BoxError, CallContext, Config, Registry, RendezvousServer, Secret,
    Transport, WireProtection,
};
use serde_json::json;

mod ddp;
mod soak;

const USAGE: &str =
    "rpc-bench: benchmarks of rpc-core against raw TCP and each other on 127.0.0.1, in peer \
processes it starts itself; one JSON object per line.

usage: rpc-bench [all|latency|throughput|tensor|rref|allreduce|overhead|trace-overhead|soak|ddp] \
[--threads N] [--busy-poll-us N] [--no-shm] [--wire-protection P] [--heartbeat-ms N] [--calls N] \
[--world-sizes N,N] [--steps N]
  --threads N        runtime worker threads of every process (default 1: two processes
                     on a 2-core machine; 0: current-thread runtime)
  --busy-poll-us N   Config::busy_poll of every process, in microseconds (default: the
                     library's, 100; 0: off)
  --no-shm           bulk blobs stream over TCP instead of shared memory
  --wire-protection P  Config::wire_protection of every process: auto (default), mac,
                     encrypt, off (on loopback auto is off)
  --heartbeat-ms N   Config::heartbeat_interval of every process (0: no failure detector;
                     default: the library's, 250)
  --calls N          calls the soak makes (default 1000000)
  overhead           the cost of the wire protection, the failure detector and the trace
  trace-overhead     the cost of the job's trace alone (off and on alternated, 6 rounds)
  soak               mixed calls among three processes: memory slope and references
  ddp                the data-parallel step (local, after, overlap, bf16) on the anchors'
                     reference model, with --world-sizes (default 2,4) and --steps (30)
Prints one JSON object per line.";

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

/// `--busy-poll-us`: `Config::busy_poll` of both processes (0: off).
static BUSY_POLL_US: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// What every process of a group is configured with besides the defaults (the driver
/// changes it between the groups of `overhead`; the processes it starts get it as flags).
#[derive(Clone, Copy, Debug)]
struct Variant {
    /// `--no-shm`: bulk blobs stream over TCP (`Config::shm_arena_bytes` 0).
    no_shm: bool,
    /// `--wire-protection`.
    protection: Option<WireProtection>,
    /// `--heartbeat-ms`.
    heartbeat_ms: Option<u64>,
    /// `--trace`: both processes record the job's trace (`Config::trace`), to
    /// [`trace_path`].
    trace: bool,
}

static VARIANT: std::sync::Mutex<Variant> = std::sync::Mutex::new(Variant {
    no_shm: false,
    protection: None,
    heartbeat_ms: None,
    trace: false,
});

/// Where a traced group's parts go (removed after each group).
fn trace_path() -> std::path::PathBuf {
    std::env::temp_dir().join("rpc-bench-trace.json")
}

fn variant() -> Variant {
    *VARIANT.lock().unwrap_or_else(|p| p.into_inner())
}

fn set_variant(v: Variant) {
    *VARIANT.lock().unwrap_or_else(|p| p.into_inner()) = v;
}

fn no_shm() -> bool {
    variant().no_shm
}

fn protection_name(p: Option<WireProtection>) -> &'static str {
    match p {
        None | Some(WireProtection::Auto) => "auto",
        Some(WireProtection::Mac) => "mac",
        Some(WireProtection::Encrypt) => "encrypt",
        Some(WireProtection::Off) => "off",
        Some(_) => "other",
    }
}

/// The flags every process of a run shares, to pass on to the processes it starts.
fn shared_flags(threads: usize) -> Vec<String> {
    let mut v = vec![
        "--threads".to_owned(),
        threads.to_string(),
        "--busy-poll-us".to_owned(),
        BUSY_POLL_US.get().copied().unwrap_or(0).to_string(),
    ];
    let var = variant();
    if var.no_shm {
        v.push("--no-shm".to_owned());
    }
    if let Some(p) = var.protection {
        v.extend([
            "--wire-protection".to_owned(),
            protection_name(Some(p)).to_owned(),
        ]);
    }
    if let Some(ms) = var.heartbeat_ms {
        v.extend(["--heartbeat-ms".to_owned(), ms.to_string()]);
    }
    if var.trace {
        v.push("--trace".to_owned());
    }
    v
}

/// How bulk blobs travel in this run, for the JSON lines.
fn bulk_path() -> &'static str {
    if no_shm() {
        "tcp"
    } else {
        "shm_if_same_host"
    }
}

fn config(rank: u32, rendezvous: &str, secret: Secret) -> Config {
    let var = variant();
    let mut cfg = Config::new();
    if let Some(p) = var.protection {
        cfg = cfg.with_wire_protection(p);
    }
    if let Some(ms) = var.heartbeat_ms {
        cfg = cfg.with_heartbeat_interval(Duration::from_millis(ms));
    }
    if var.trace {
        cfg = cfg.with_trace(trace_path());
    }
    cfg.with_rank(rank)
        .with_world_size(2)
        .with_name(if rank == 0 { "bench" } else { "peer" })
        .with_init_method(format!("tcp://{rendezvous}"))
        .with_serve_rendezvous(false)
        .with_secret(secret)
        .with_init_timeout(Duration::from_secs(30))
        .with_busy_poll(Duration::from_micros(
            BUSY_POLL_US.get().copied().unwrap_or(0),
        ))
        .with_shm_arena_bytes(if no_shm() { 0 } else { 128 << 20 })
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
    if matches!(mode, "-h" | "--help" | "help") {
        println!("{USAGE}");
        return Ok(());
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
        "overhead" => overhead(threads, false),
        "trace-overhead" => overhead(threads, true),
        "ddp" => {
            // One compute thread per process, like the anchor (set before any thread exists).
            std::env::set_var("RAYON_NUM_THREADS", "1");
            let steps: usize = value("--steps")?
                .map(|v| v.parse())
                .transpose()?
                .unwrap_or(30);
            let rt = runtime(threads)?;
            emit(rt.block_on(ddp::local(steps))?);
            for n in ddp::world_sizes(value("--world-sizes")?)? {
                let (agent, _peers) = group(&rt, threads, n, "rank0", |rank, addr| {
                    vec![
                        "ddp-rank".into(),
                        n.to_string(),
                        rank.to_string(),
                        addr.into(),
                        steps.to_string(),
                    ]
                })?;
                let a = agent.clone();
                let lines =
                    rt.block_on(rt.spawn(async move { ddp::rank_main(&a, steps).await }))??;
                lines.into_iter().for_each(emit);
                rt.block_on(agent.shutdown());
            }
            Ok(())
        }
        "ddp-rank" => {
            // One member of a `ddp` group (started by `ddp`).
            std::env::set_var("RAYON_NUM_THREADS", "1");
            let n: u32 = args.get(1).context("world size")?.parse()?;
            let rank: u32 = args.get(2).context("rank")?.parse()?;
            let rendezvous = args.get(3).context("rendezvous address")?;
            let steps: usize = args.get(4).context("steps")?.parse()?;
            let rt = runtime(threads)?;
            rt.block_on(async {
                let cfg = config(rank, rendezvous, Secret::from_env()?.context("no secret")?)
                    .with_world_size(n)
                    .with_name(format!("rank{rank}"));
                let agent = rpc_core::init(cfg, registry()).await?;
                ddp::rank_main(&agent, steps).await?;
                agent.wait_for_group().await;
                Ok(())
            })
        }
        "soak" => {
            let calls = value("--calls")?.map(|v| v.parse()).transpose()?;
            soak_group(threads, calls.unwrap_or(1_000_000))
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
    let peer_rss = rt.block_on(agent.rpc_async(1u32, peak_rss, ()))?;
    emit(tag(json!({
        "metric": "peak_rss_mb",
        "phase": "control",
        "process": "bench",
        "median": peak_rss_mb(),
    })));
    emit(tag(json!({
        "metric": "peak_rss_mb",
        "phase": "control",
        "process": "peer",
        "median": peer_rss,
    })));
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
        let peer_rss = rt.block_on(agent.rpc_async(1u32, peak_rss, ()))?;
        emit(tag(json!({
            "metric": "peak_rss_mb",
            "phase": "after_64MiB_echo",
            "process": "bench",
            "median": peak_rss_mb(),
        })));
        emit(tag(json!({
            "metric": "peak_rss_mb",
            "phase": "after_64MiB_echo",
            "process": "peer",
            "median": peer_rss,
        })));
    }
    let report = rt.block_on(agent.shutdown());
    if !report.is_clean() {
        bail!("shutdown not clean: {report:?}");
    }
    Ok(())
}

/// Raw 64-byte TCP ping-pong (blocking, and polling as the framework's waits do when busy
/// polling is on), `rpc_sync` and sequential `rpc_async` round trips, measured in
/// alternating batches of 100 so all see the same machine state (this matters on noisy VMs,
/// where the raw round trip alone drifts several-fold within minutes). Ratios are to the
/// faster raw ping-pong.
fn latency(
    rt: &tokio::runtime::Runtime,
    agent: &Agent,
    echo_port: u16,
    with_sync: bool,
) -> Result<Vec<serde_json::Value>> {
    const ROUNDS: usize = 55;
    const BATCH: usize = 100;
    let mut blocking = RawConn::connect(echo_port, false)?;
    let mut polled = RawConn::connect(echo_port, true)?;
    let (mut raw, mut raw_polled, mut sync, mut asy) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let keep = round >= 5;
        for _ in 0..BATCH {
            let x = blocking.ping()?;
            if keep {
                raw.push(x);
            }
        }
        if !busy_poll().is_zero() {
            for _ in 0..BATCH {
                let x = polled.ping()?;
                if keep {
                    raw_polled.push(x);
                }
            }
        }
        if with_sync {
            for _ in 0..BATCH {
                let t = Instant::now();
                agent.rpc_sync(1u32, noop, ())?;
                if keep {
                    sync.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
        }
        // Run the async caller as a task on the runtime (as real callers are), not on the
        // thread blocked in `block_on`, which would add two thread hand-offs per call.
        let a = agent.clone();
        let batch: Vec<f64> = rt.block_on(rt.spawn(async move {
            let mut v = Vec::with_capacity(BATCH);
            for _ in 0..BATCH {
                let t = Instant::now();
                a.rpc_async(1u32, noop, ()).await?;
                v.push(t.elapsed().as_secs_f64() * 1e6);
            }
            Ok::<_, rpc_core::RpcError>(v)
        }))??;
        if keep {
            asy.extend(batch);
        }
    }
    let raw = stats(raw);
    let mut out = vec![json!({
        "metric": "raw_tcp_pingpong_64B_rtt_us",
        "median": raw.median,
        "p99": raw.p99,
        "n": 5000,
    })];
    let mut floor = raw.median;
    if !raw_polled.is_empty() {
        let st = stats(raw_polled);
        floor = floor.min(st.median);
        out.push(json!({
            "metric": "raw_tcp_pingpong_64B_polled_rtt_us",
            "median": st.median,
            "p99": st.p99,
            "n": 5000,
        }));
    }
    for (name, xs) in [
        ("rpc_sync_noop_rtt_us", sync),
        ("rpc_async_noop_rtt_us", asy),
    ] {
        if xs.is_empty() {
            continue;
        }
        let st = stats(xs);
        out.push(json!({
            "metric": name, "median": st.median, "p99": st.p99, "n": 5000,
            "raw_tcp_us": floor, "ratio_to_raw_tcp": st.median / floor,
        }));
    }
    Ok(out)
}

fn raw_stream(port: u16) -> Result<serde_json::Value> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    let data = vec![1u8; 64 << 20];
    let mut xs = Vec::new();
    for i in 0..12 {
        let t = Instant::now();
        s.write_all(&(data.len() as u64).to_le_bytes())?;
        s.write_all(&data)?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)?;
        if i >= 2 {
            xs.push(data.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    let st = stats(xs);
    Ok(json!({ "metric": "raw_tcp_stream_GBps", "median": st.median, "p99": st.p99, "n": 10 }))
}

async fn throughput(agent: &Agent) -> Result<serde_json::Value> {
    const CALLS: usize = 20_000;
    const IN_FLIGHT: usize = 2_000;
    let mut rates = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        let mut results =
            futures::stream::iter((0..CALLS).map(|_| agent.rpc_async(1u32, noop, ())))
                .buffer_unordered(IN_FLIGHT);
        while let Some(r) = results.next().await {
            r?;
        }
        rates.push(CALLS as f64 / t.elapsed().as_secs_f64());
    }
    let st = stats(rates[1..].to_vec());
    Ok(json!({
        "metric": "rpc_async_noop_calls_per_s",
        "median": st.median,
        "calls_per_s": st.median,
        "in_flight": IN_FLIGHT,
        "calls": CALLS,
        "runs": 6,
    }))
}

async fn echo_bench(
    agent: &Agent,
    name: &str,
    bytes: usize,
    iters: usize,
) -> Result<serde_json::Value> {
    let data = Blob::from((0..bytes).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let warm = (iters / 10).max(2);
    let mut xs = Vec::with_capacity(iters);
    for i in 0..iters + warm {
        let t = Instant::now();
        let back = agent.rpc_async(1u32, echo, (data.clone(),)).await?;
        let dt = t.elapsed().as_secs_f64();
        if back.len() != bytes {
            bail!("echo returned {} bytes, sent {bytes}", back.len());
        }
        if i >= warm {
            xs.push(dt * 1e6);
        }
    }
    let st = stats(xs);
    let gbps = 2.0 * bytes as f64 / (st.median / 1e6) / 1e9;
    Ok(json!({
        "metric": name,
        "median": st.median,
        "p99": st.p99,
        "effective_GBps": gbps,
        "bytes": bytes,
        "n": iters,
    }))
}

/// Rounds of the RRef benchmarks (the first `RREF_WARM` are warm-up), each a batch of raw
/// ping-pongs and a batch of the operation measured.
const RREF_ROUNDS: usize = 35;
const RREF_WARM: usize = 5;
const RREF_BATCH: usize = 100;
const RREF_N: usize = (RREF_ROUNDS - RREF_WARM) * RREF_BATCH;

/// Raw 64-byte ping-pongs on a blocking socket, measured between the batches of an RRef
/// benchmark so that both see the same machine state, as in [`latency`]. (On this VM an idle
/// vCPU halts and takes an extra ~100 µs to wake; a run of back-to-back round trips keeps
/// it from halting, and a benchmark that measures without its baseline beside it reports
/// the machine's mood as much as the code.)
struct RawPing {
    conn: RawConn,
    xs: Vec<f64>,
}

impl RawPing {
    /// Polling like the framework's waits when busy polling is on.
    fn connect(port: u16) -> Result<Self> {
        Ok(Self {
            conn: RawConn::connect(port, !busy_poll().is_zero())?,
            xs: Vec::new(),
        })
    }

    fn batch(&mut self, keep: bool) -> Result<()> {
        for _ in 0..RREF_BATCH {
            let x = self.conn.ping()?;
            if keep {
                self.xs.push(x);
            }
        }
        Ok(())
    }

    /// Runs `batch` (which times `RREF_BATCH` operations) in rounds alternating with raw
    /// batches; the times of the rounds after the warm-up.
    fn interleave(&mut self, mut batch: impl FnMut() -> Result<Vec<f64>>) -> Result<Vec<f64>> {
        let mut xs = Vec::with_capacity(RREF_N);
        for round in 0..RREF_ROUNDS {
            let keep = round >= RREF_WARM;
            self.batch(keep)?;
            let b = batch()?;
            anyhow::ensure!(
                b.len() == RREF_BATCH,
                "a batch timed {} operations",
                b.len()
            );
            if keep {
                xs.extend(b);
            }
        }
        Ok(xs)
    }
}

/// Times `RREF_BATCH` runs of `op` as a task on the runtime (as real async callers run).
fn on_runtime<Fut>(
    rt: &tokio::runtime::Runtime,
    op: impl Fn() -> Fut + Send + 'static,
) -> Result<Vec<f64>>
where
    Fut: std::future::Future<Output = Result<()>> + Send,
{
    rt.block_on(rt.spawn(async move {
        let mut v = Vec::with_capacity(RREF_BATCH);
        for _ in 0..RREF_BATCH {
            let t = Instant::now();
            op().await?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok(v)
    }))?
}

/// Times `RREF_BATCH` runs of `op` on this (plain) thread.
fn on_thread(mut op: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    let mut v = Vec::with_capacity(RREF_BATCH);
    for _ in 0..RREF_BATCH {
        let t = Instant::now();
        op()?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(v)
}

/// The RRef operations of PyTorch's `bench_rref.py`: `remote` (+ `to_here`), `to_here` of an
/// existing reference and a method call, from a task (async) and from a plain thread
/// (blocking, as PyTorch's, called from Python's main thread), each in batches alternating
/// with raw ping-pongs (`raw_tcp_us` and `ratio_to_raw_tcp` on every line).
fn rref_metrics(
    rt: &tokio::runtime::Runtime,
    agent: &Agent,
    echo_port: u16,
) -> Result<Vec<serde_json::Value>> {
    let mut raw = RawPing::connect(echo_port)?;
    let mut timed: Vec<(&str, Vec<f64>)> = Vec::new();
    // remote + to_here; the handle is dropped each time (delete traffic included).
    let a = agent.clone();
    let xs = raw.interleave(|| {
        let a = a.clone();
        on_runtime(rt, move || {
            let a = a.clone();
            async move {
                let r = rref::remote(&a, 1u32, new_counter, (1,))?;
                let c = r.to_here().await?;
                anyhow::ensure!(c.value == 1, "wrong value");
                Ok(())
            }
        })
    })?;
    timed.push(("remote_to_here_us", xs));
    let a = agent.clone();
    timed.push((
        "remote_create_us",
        rt.block_on(rt.spawn(async move { remote_create(&a).await }))??,
    ));
    let existing = rref::remote(agent, 1u32, new_counter, (5,))?;
    existing.to_here_blocking()?;
    let e = existing.clone();
    let xs = raw.interleave(|| {
        let e = e.clone();
        on_runtime(rt, move || {
            let e = e.clone();
            async move {
                anyhow::ensure!(e.to_here().await?.value == 5, "wrong value");
                Ok(())
            }
        })
    })?;
    timed.push(("to_here_existing_us", xs));
    let counter = rref::remote(agent, 1u32, new_counter, (0,))?;
    let c = counter.clone();
    let xs = raw.interleave(|| {
        let c = c.clone();
        on_runtime(rt, move || {
            let c = c.clone();
            async move {
                c.rpc_async(incr, (1,)).await?;
                Ok(())
            }
        })
    })?;
    timed.push(("rref_rpc_async_method_us", xs));
    // The blocking forms, from this thread.
    let xs = raw.interleave(|| {
        on_thread(|| {
            let r = rref::remote(agent, 1u32, new_counter, (1,))?;
            anyhow::ensure!(r.to_here_blocking()?.value == 1, "wrong value");
            Ok(())
        })
    })?;
    timed.push(("remote_to_here_blocking_us", xs));
    let xs = raw.interleave(|| {
        on_thread(|| {
            anyhow::ensure!(existing.to_here_blocking()?.value == 5, "wrong value");
            Ok(())
        })
    })?;
    timed.push(("to_here_existing_blocking_us", xs));
    let before = counter.to_here_blocking()?.value;
    let xs = raw.interleave(|| {
        on_thread(|| {
            counter.rpc_sync(incr, (1,))?;
            Ok(())
        })
    })?;
    let calls = (RREF_ROUNDS * RREF_BATCH) as i64;
    anyhow::ensure!(
        counter.to_here_blocking()?.value == before + calls,
        "the counter missed increments"
    );
    timed.push(("rref_rpc_sync_method_us", xs));
    let raw = stats(raw.xs).median;
    Ok(timed
        .into_iter()
        .map(|(name, xs)| {
            let st = stats(xs);
            json!({
                "metric": name, "median": st.median, "p99": st.p99, "n": RREF_N,
                "raw_tcp_us": raw, "ratio_to_raw_tcp": st.median / raw,
            })
        })
        .collect())
}

/// `remote` alone (it returns without waiting for the owner), 3,500 times; then waits for
/// the values to be confirmed and released.
async fn remote_create(agent: &Agent) -> Result<Vec<f64>> {
    let n = RREF_WARM * RREF_BATCH + RREF_N;
    let mut keep = Vec::with_capacity(n);
    let mut xs = Vec::with_capacity(RREF_N);
    for i in 0..n {
        let t = Instant::now();
        keep.push(rref::remote(agent, 1u32, new_counter, (1,))?);
        if i >= RREF_WARM * RREF_BATCH {
            xs.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !keep.iter().all(|r| r.confirmed_by_owner()) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(keep);
    let deadline = Instant::now() + Duration::from_secs(60);
    while rref::debug_info(agent).messages_in_flight > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(xs)
}

const ALLREDUCE_ITERS: usize = 8;

/// The timed loop every member runs: a barrier, then all-reduces of 64 MiB and 1 MiB in place
/// (as `torch.distributed.all_reduce` and gloo work), and of a 64 MiB tensor into a new one.
/// Returns the metric name, size and per-iteration times seen by this member, in
/// milliseconds.
async fn allreduce_loop(agent: &Agent) -> Result<Vec<(&'static str, usize, Vec<f64>)>> {
    let g = collectives::world(agent);
    let n = g.size() as f32;
    let mut out = Vec::new();
    for (name, bytes) in [
        ("all_reduce_64MiB_ms", 64usize << 20),
        ("all_reduce_1MiB_ms", 1 << 20),
    ] {
        let mut x = vec![1.0f32; bytes / 4];
        let mut times = Vec::new();
        for i in 0..ALLREDUCE_ITERS + 2 {
            g.barrier().await?;
            let t = Instant::now();
            g.all_reduce_in_place(&mut x, collectives::ReduceOp::Sum)
                .await?;
            let dt = t.elapsed().as_secs_f64() * 1e3;
            // Every element was 1 on every member.
            let want = n;
            anyhow::ensure!(
                x[0] == want && x[x.len() - 1] == want,
                "all_reduce_in_place gave {} and {}, not {want}",
                x[0],
                x[x.len() - 1]
            );
            x.iter_mut().for_each(|v| *v = 1.0);
            if i >= 2 {
                times.push(dt);
            }
        }
        out.push((name, bytes, times));
    }
    let bytes = 64usize << 20;
    let x = candle_core::Tensor::ones(
        bytes / 4,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?;
    let mut times = Vec::new();
    for i in 0..ALLREDUCE_ITERS + 2 {
        g.barrier().await?;
        let t = Instant::now();
        let y = g.all_reduce(&x, collectives::ReduceOp::Sum).await?;
        let dt = t.elapsed().as_secs_f64() * 1e3;
        let s = y.narrow(0, bytes / 4 - 1, 1)?.to_vec1::<f32>()?[0];
        anyhow::ensure!(s == n, "all_reduce gave {s}");
        if i >= 2 {
            times.push(dt);
        }
    }
    out.push(("all_reduce_tensor_64MiB_ms", bytes, times));
    Ok(out)
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

fn allreduce_bench(n: u32, threads: usize) -> Result<()> {
    let rt = runtime(threads)?;
    let (agent, _peers) = group(&rt, threads, n, "rank0", |rank, addr| {
        vec![
            "allreduce-rank".into(),
            n.to_string(),
            rank.to_string(),
            addr.into(),
        ]
    })?;
    // One-stream loopback TCP measured in the same run: the yardstick the bus bandwidth is
    // compared with (this machine's bandwidth drifts several-fold within minutes).
    let (_, sink_port) = rt.block_on(agent.rpc_async(1u32, raw_servers, ()))?;
    let tcp = raw_stream(sink_port)?;
    let tcp_gbps = tcp["median"].as_f64().unwrap_or(f64::NAN);
    emit(json!({
        "metric": "raw_tcp_stream_GBps",
        "processes": n,
        "median": tcp_gbps,
        "p99": tcp["p99"],
    }));
    let a = agent.clone();
    let results = rt.block_on(rt.spawn(async move { allreduce_loop(&a).await }))??;
    for (name, bytes, times) in results {
        let st = stats(times);
        let busbw = 2.0 * (n as f64 - 1.0) / n as f64 * bytes as f64 / (st.median / 1e3) / 1e9;
        let api = if name.contains("tensor") {
            "tensor"
        } else {
            "in_place"
        };
        emit(json!({
            "metric": name,
            "api": api,
            "processes": n,
            "median": st.median,
            "p99": st.p99,
            "busbw_GBps": busbw,
            "busbw_over_tcp_stream": busbw / tcp_gbps,
            "n": ALLREDUCE_ITERS,
            "transport": "tcp",
            "bulk": bulk_path(),
        }));
    }
    emit(json!({
        "metric": "peak_rss_mb",
        "phase": "allreduce",
        "processes": n,
        "process": "rank0",
        "median": peak_rss_mb(),
    }));
    rt.block_on(agent.shutdown());
    Ok(())
}

/// What one group of `overhead` measured: the medians of its lines, by metric.
type Medians = std::collections::BTreeMap<String, f64>;

/// The CPU time both processes spend in `secs` seconds of idleness, in milliseconds per
/// second (heartbeats, timers, nothing else running).
fn idle_cpu(rt: &tokio::runtime::Runtime, agent: &Agent, secs: u64) -> Result<(f64, f64)> {
    let here = cpu_seconds_here();
    let peer = rt.block_on(agent.rpc_async(1u32, cpu_seconds, ()))?;
    std::thread::sleep(Duration::from_secs(secs));
    let here = cpu_seconds_here() - here;
    let peer = rt.block_on(agent.rpc_async(1u32, cpu_seconds, ()))? - peer;
    Ok((here * 1e3 / secs as f64, peer * 1e3 / secs as f64))
}

/// Measures one group of the current variant; emits its lines tagged with `tags`.
fn overhead_group(
    threads: usize,
    tags: &serde_json::Value,
    bulk: bool,
    idle: bool,
) -> Result<Medians> {
    let rt = runtime(threads)?;
    let (agent, _guard) = pair(&rt, threads)?;
    let (echo_port, _) = rt.block_on(agent.rpc_async(1u32, raw_servers, ()))?;
    let mut lines = latency(&rt, &agent, echo_port, threads > 0)?;
    let a = agent.clone();
    lines.push(rt.block_on(rt.spawn(async move { throughput(&a).await }))??);
    if bulk {
        for (name, bytes, iters) in [
            ("echo_1MiB_rtt_us", 1usize << 20, 200),
            ("echo_64MiB_rtt_us", 64 << 20, 12),
        ] {
            let a = agent.clone();
            lines.push(
                rt.block_on(rt.spawn(async move { echo_bench(&a, name, bytes, iters).await }))??,
            );
        }
    }
    if idle {
        let (here, peer) = idle_cpu(&rt, &agent, 3)?;
        lines.push(json!({ "metric": "idle_cpu_ms_per_s", "process": "bench", "median": here }));
        lines.push(json!({ "metric": "idle_cpu_ms_per_s", "process": "peer", "median": peer }));
    }
    let mut medians = Medians::new();
    for mut v in lines {
        let key = match v["process"].as_str() {
            Some(p) => format!("{}:{p}", v["metric"].as_str().unwrap_or("?")),
            None => v["metric"].as_str().unwrap_or("?").to_owned(),
        };
        if let Some(m) = v["median"].as_f64() {
            medians.insert(key, m);
        }
        if let (Some(o), Some(t)) = (v.as_object_mut(), tags.as_object()) {
            for (k, x) in t {
                o.insert(k.clone(), x.clone());
            }
        }
        emit(v);
    }
    let report = rt.block_on(agent.shutdown());
    if !report.is_clean() {
        bail!("shutdown not clean: {report:?}");
    }
    Ok(medians)
}

/// `overhead`: the wire protection's and the failure detector's cost, variants alternated
/// over `ROUNDS` rounds, each in a fresh group; then each variant's medians (over its rounds)
/// as ratios to its baseline's.
fn overhead(threads: usize, only_trace: bool) -> Result<()> {
    // The trace alone: more rounds, since each is short.
    let rounds = if only_trace { 6 } else { 3 };
    let base = variant();
    let protections = [
        WireProtection::Off,
        WireProtection::Mac,
        WireProtection::Encrypt,
    ];
    let detectors: [(&str, u64); 2] = [
        ("off", 0),
        (
            "on",
            Config::new()
                .heartbeat_interval
                .map_or(250, |d| d.as_millis() as u64),
        ),
    ];
    let mut by_protection: Vec<Vec<Medians>> = vec![Vec::new(); protections.len()];
    let mut by_detector: Vec<Vec<Medians>> = vec![Vec::new(); detectors.len()];
    let mut by_trace: Vec<Vec<Medians>> = vec![Vec::new(); 2];
    for round in 0..rounds {
        // Each order in turn: the second group of a round is often the slower one here.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let on = i == 1;
            set_variant(Variant { trace: on, ..base });
            let tags = json!({ "trace": on, "round": round });
            by_trace[i].push(overhead_group(threads, &tags, false, false)?);
            let _ = std::fs::remove_dir_all(rpc_core::trace::parts_dir(&trace_path()));
        }
        if only_trace {
            continue;
        }
        for (i, p) in protections.iter().enumerate() {
            set_variant(Variant {
                no_shm: true,
                protection: Some(*p),
                heartbeat_ms: base.heartbeat_ms,
                trace: false,
            });
            let tags = json!({
                "wire_protection": protection_name(Some(*p)),
                "bulk": "tcp",
                "round": round,
            });
            by_protection[i].push(overhead_group(threads, &tags, true, false)?);
        }
        for (i, (name, ms)) in detectors.iter().enumerate() {
            set_variant(Variant {
                heartbeat_ms: Some(*ms),
                ..base
            });
            let tags = json!({ "detector": name, "heartbeat_ms": ms, "round": round });
            by_detector[i].push(overhead_group(threads, &tags, false, true)?);
        }
    }
    set_variant(base);
    let merged = |runs: &[Medians]| -> Medians {
        let mut out = Medians::new();
        for key in runs
            .iter()
            .flat_map(|m| m.keys())
            .collect::<std::collections::BTreeSet<_>>()
        {
            let xs: Vec<f64> = runs.iter().filter_map(|m| m.get(key).copied()).collect();
            out.insert(key.clone(), stats(xs).median);
        }
        out
    };
    let ratios = |tags: serde_json::Value, m: &Medians, base: &Medians| {
        let mut v = tags;
        for (k, x) in m {
            if let Some(b) = base.get(k) {
                v[format!("{k}_ratio")] = json!(x / b);
                v[k.clone()] = json!(x);
            }
        }
        emit(v);
    };
    ratios(
        json!({
            "metric": "trace_cost",
            "trace": "on",
            "baseline": "off",
            "rounds": rounds,
        }),
        &merged(&by_trace[1]),
        &merged(&by_trace[0]),
    );
    if only_trace {
        return Ok(());
    }
    let off = merged(&by_protection[0]);
    for (i, p) in protections.iter().enumerate().skip(1) {
        ratios(
            json!({
                "metric": "wire_protection_cost",
                "wire_protection": protection_name(Some(*p)),
                "baseline": "off",
                "rounds": rounds,
            }),
            &merged(&by_protection[i]),
            &off,
        );
    }
    let no_detector = merged(&by_detector[0]);
    let with = merged(&by_detector[1]);
    ratios(
        json!({
            "metric": "failure_detector_cost",
            "detector": "on",
            "heartbeat_ms": detectors[1].1,
            "baseline": "off",
            "rounds": rounds,
        }),
        &with,
        &no_detector,
    );
    Ok(())
}
