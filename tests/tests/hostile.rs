//! Crafted input against a worker process: one test per way a frame (or a connection) that
//! passes authentication, or one that never authenticates, used to crash or exhaust a worker.
//! After each attack the worker must still serve calls, and its peak resident memory must
//! have grown by less than 100 MB.
//!
//! The target is `rpc-test-worker serve` as rank 1 of a group of two; rank 0 is an agent in
//! this test's process, so the test knows the group secret and can speak the wire protocol
//! to the worker directly (`rpc_core::testing::RawRequest`).

use std::time::{Duration, Instant};

use autograd_dist::DeviceSpec;
use integration_tests::procs::{self, Procs};
use integration_tests::{add, autograd_fns, registry_builder, rref_fns};
use rpc_core::testing::{self, Io, RawRequest};
use rpc_core::{
    remote, Agent, BoxError, CallContext, Config, Registry, RendezvousServer, Secret, Transport,
};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

/// Peak RSS growth allowed per attack.
const MAX_GROWTH_KB: u64 = 100 << 10;

/// A worker process under attack, beside this process's rank 0.
struct Target {
    rt: tokio::runtime::Runtime,
    procs: Procs,
    agent: Agent,
    /// The worker's RPC address.
    addr: String,
    secret: Secret,
    /// Its peak RSS (kB) after warm-up.
    base_hwm_kb: u64,
}

fn status_kb(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

impl Target {
    fn start() -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let secret = Secret::generate();
        let server = rt
            .block_on(RendezvousServer::start(
                &Transport::Tcp,
                "127.0.0.1:0",
                secret.clone(),
                2,
                Duration::from_secs(30),
            ))
            .unwrap();
        let mut procs = procs::spawn(
            env!("CARGO_BIN_EXE_rpc-test-worker"),
            &[(1, "serve")],
            2,
            server.local_addr(),
            &secret,
            &[],
        );
        let cfg = Config::new()
            .with_rank(0)
            .with_world_size(2)
            .with_init_method(format!("tcp://{}", server.local_addr()))
            .with_serve_rendezvous(false)
            .with_secret(secret.clone())
            .with_shutdown_timeout(Duration::from_secs(20));
        let registry = collectives::install(registry_builder()).unwrap();
        let registry = autograd_fns::register(rref_fns::register(registry)).build();
        let agent = rt
            .block_on(async {
                let agent = rpc_core::init(cfg, registry).await;
                server.finish(Duration::from_secs(5)).await;
                agent
            })
            .unwrap();
        let ready = procs.expect(1, "READY", Duration::from_secs(30));
        let addr = ready.split_whitespace().nth(1).unwrap().to_owned();
        let t = Self {
            rt,
            procs,
            agent,
            addr,
            secret,
            base_hwm_kb: 0,
        };
        // Warm up: the connection, a blob, so the baseline includes the steady state.
        for i in 0..20 {
            t.healthy(i);
        }
        let blob = rpc_core::Blob::from(vec![7u8; 1 << 20]);
        let back =
            t.rt.block_on(
                t.agent
                    .rpc_async(1u32, integration_tests::echo, (blob.clone(),)),
            )
            .unwrap();
        assert_eq!(back, blob);
        Self {
            base_hwm_kb: status_kb(t.pid(), "VmHWM:"),
            ..t
        }
    }

    fn pid(&self) -> u32 {
        self.procs.children[0].id()
    }

    /// The worker answers a call from the group (over the connection the agent holds).
    fn healthy(&self, i: i32) {
        let r = self.rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(10),
                self.agent.rpc_async(1u32, add, (i, 1)),
            )
            .await
        });
        match r {
            Ok(Ok(v)) => assert_eq!(v, i + 1),
            Ok(Err(e)) => panic!("the worker stopped serving: {}", rpc_core::error_chain(&e)),
            Err(_) => panic!("the worker did not answer within 10 s"),
        }
    }

    /// Asserts the worker still serves (also on a fresh authenticated connection) and its peak
    /// RSS grew by less than [`MAX_GROWTH_KB`].
    fn survived(&self, attack: &str) {
        self.survived_within(attack, MAX_GROWTH_KB);
    }

    /// [`Target::survived`], with a peak RSS growth limit of `max_kb`.
    fn survived_within(&self, attack: &str, max_kb: u64) {
        assert!(self.procs_alive(), "{attack}: the worker process is gone");
        self.healthy(41);
        let reply = self.rt.block_on(async {
            let mut c = self.dial(false).await;
            let req = RawRequest::call::<add, _>(&(20, 22));
            c.write_all(&req.frame()).await.unwrap();
            c.flush().await.unwrap();
            testing::read_reply::<add>(&mut c, req.id, Duration::from_secs(10)).await
        });
        let sum = reply
            .unwrap_or_else(|e| panic!("{attack}: a fresh connection got no reply: {e}"))
            .unwrap_or_else(|e| panic!("{attack}: a fresh call failed: {e}"));
        assert_eq!(sum, 42);
        let grown = status_kb(self.pid(), "VmHWM:").saturating_sub(self.base_hwm_kb);
        eprintln!("{attack}: peak RSS grew {grown} kB");
        assert!(
            grown < max_kb,
            "{attack}: peak RSS grew {grown} kB (limit {max_kb} kB)"
        );
    }

    fn procs_alive(&self) -> bool {
        std::path::Path::new(&format!("/proc/{}/status", self.pid())).exists()
            && !status_kb_str(self.pid(), "State:").starts_with('Z')
    }

    async fn dial(&self, sync: bool) -> Box<dyn Io> {
        let r = if sync {
            testing::dial_authenticated_sync(&Transport::Tcp, &self.addr, &self.secret, 0).await
        } else {
            testing::dial_authenticated(&Transport::Tcp, &self.addr, &self.secret, 0).await
        };
        r.expect("authenticated connection")
    }

    /// Sends `frame` (a call of `F`) on a fresh connection of each kind (control, then a
    /// blocking caller's own) and returns what came back on each: the reply, or how the
    /// connection ended.
    fn send_both<F: rpc_core::RemoteFn>(&self, frame: &[u8], id: u64) -> Vec<Reply<F::Output>> {
        [false, true]
            .into_iter()
            .map(|sync| {
                self.rt.block_on(async {
                    let mut c = self.dial(sync).await;
                    c.write_all(frame).await.map_err(|e| e.to_string())?;
                    c.flush().await.map_err(|e| e.to_string())?;
                    match testing::read_reply::<F>(&mut c, id, Duration::from_secs(10)).await {
                        Ok(r) => Ok(r.map_err(|e| e.to_string())),
                        Err(e) => Err(e.to_string()),
                    }
                })
            })
            .collect()
    }

    fn finish(mut self) {
        let report = self.rt.block_on(self.agent.shutdown());
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(
            self.procs.expect(1, "SHUTDOWN", Duration::from_secs(30)),
            "clean=true barrier=Ok(())"
        );
        assert_eq!(self.procs.wait_all(Duration::from_secs(30)), vec![Some(0)]);
    }
}

fn status_kb_str(pid: u32, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_owned()))
        .unwrap_or_default()
}

/// What came back for a raw request: the result or the error reply, or how the connection
/// ended.
type Reply<T> = Result<Result<T, String>, String>;

#[test]
fn a_deadline_past_the_end_of_time_is_served_not_a_panic() {
    let t = Target::start();
    // tarpc computed `Instant::now() + deadline`, which panics for this one.
    let mut req = RawRequest::call::<add, _>(&(1, 2));
    req.deadline = Duration::new(u64::MAX, 999_999_999);
    for (kind, got) in ["control", "sync"]
        .iter()
        .zip(t.send_both::<add>(&req.frame(), req.id))
    {
        let sum = got
            .unwrap_or_else(|e| panic!("{kind}: connection ended: {e}"))
            .unwrap_or_else(|e| panic!("{kind}: call failed: {e}"));
        assert_eq!(sum, 3, "{kind}");
    }
    t.survived("deadline u64::MAX");
    t.finish();
}

#[test]
fn the_deepest_call_depth_does_not_overflow() {
    let t = Target::start();
    // The callee runs the handler at `depth + 1`.
    let mut req = RawRequest::call::<add, _>(&(5, 6));
    req.depth = u32::MAX;
    for (kind, got) in ["control", "sync"]
        .iter()
        .zip(t.send_both::<add>(&req.frame(), req.id))
    {
        let sum = got
            .unwrap_or_else(|e| panic!("{kind}: connection ended: {e}"))
            .unwrap_or_else(|e| panic!("{kind}: call failed: {e}"));
        assert_eq!(sum, 11, "{kind}");
    }
    t.survived("depth u32::MAX");
    t.finish();
}

/// Asserts the frame was refused: the connection ended or the call got an error, never a
/// result.
fn refused<T>(attack: &str, got: Vec<Reply<T>>) {
    for (kind, got) in ["control", "sync"].iter().zip(got) {
        match got {
            Ok(Ok(_)) => panic!("{attack} over {kind}: the call was served"),
            Ok(Err(e)) => eprintln!("{attack} over {kind}: error reply: {e}"),
            Err(e) => eprintln!("{attack} over {kind}: connection ended: {e}"),
        }
    }
}

/// A call to `add` with `edit` applied, sent 4 times over both kinds of connection: refused
/// each time, and the worker survives.
fn refused_without_ballooning(what: &str, edit: impl FnOnce(&mut RawRequest)) {
    let t = Target::start();
    let mut req = RawRequest::call::<add, _>(&(1, 1));
    edit(&mut req);
    let frame = req.frame();
    for _ in 0..4 {
        refused(what, t.send_both::<add>(&frame, req.id));
    }
    t.survived(what);
    t.finish();
}

#[test]
fn millions_of_metadata_entries_are_refused_without_ballooning() {
    // 2 bytes each on the wire, 48 in memory: a 30 MB frame (under the 32 MiB limit) that
    // used to ask for 720 MB.
    refused_without_ballooning("15M metadata entries", |r| r.meta_entries = 15_000_000);
}

#[test]
fn millions_of_blob_entries_are_refused_without_ballooning() {
    // 2 bytes each on the wire, 32 in memory: 30 MB that used to ask for 480 MB.
    refused_without_ballooning("15M blob entries", |r| r.padding_blobs = 15_000_000);
}

#[test]
fn announced_frame_lengths_do_not_allocate() {
    let t = Target::start();
    // 20 connections of each kind announce the largest frame allowed (32 MiB) and send 64 KiB
    // of it; buffers that followed the announcement would hold 1.25 GiB.
    let limit = 32u32 << 20;
    let conns = t.rt.block_on(async {
        let mut conns = Vec::new();
        for i in 0..40 {
            let mut c = t.dial(i % 2 == 1).await;
            c.write_all(&limit.to_be_bytes()).await.unwrap();
            c.write_all(&vec![0u8; 64 << 10]).await.unwrap();
            c.flush().await.unwrap();
            conns.push(c);
        }
        conns
    });
    std::thread::sleep(Duration::from_millis(300));
    t.survived("40 announced 32 MiB frames");
    // A frame announced above the limit ends its connection at once.
    for sync in [false, true] {
        let ended = t.rt.block_on(async {
            let mut c = t.dial(sync).await;
            c.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
            c.flush().await.unwrap();
            testing::read_reply::<add>(&mut c, 1, Duration::from_secs(5)).await
        });
        let e = ended.expect_err("a frame above the limit was read");
        assert_ne!(e.kind(), std::io::ErrorKind::TimedOut, "sync={sync}: {e}");
    }
    drop(conns);
    t.survived("frames above the limit");
    t.finish();
}

/// Mirrors how `RTensor` travels, so the test can send shapes no tensor has.
#[derive(Serialize)]
struct FakeTensor {
    dtype: String,
    shape: Vec<usize>,
    device: DeviceSpec,
    data: rpc_core::Blob,
    tag: Option<()>,
}

#[test]
fn tensors_whose_shape_exceeds_their_bytes_are_refused() {
    let t = Target::start();
    let cases = [
        // The element count overflows: the product wrapped to a small number before.
        ("f32", vec![usize::MAX / 2 + 1, 4], 8, "too large"),
        ("f32", vec![1 << 33, 1 << 33], 0, "too large"),
        // Packed dtypes have size 0: the check was skipped and the kernels read past the end.
        ("f4", vec![1 << 20], 16, "needs"),
        ("f6e2m3", vec![4096], 1, "needs"),
        // Plainly short.
        ("f32", vec![1000], 40, "needs"),
    ];
    for (dtype, shape, bytes, says) in cases {
        let fake = FakeTensor {
            dtype: dtype.into(),
            shape: shape.clone(),
            device: DeviceSpec::Cpu,
            data: rpc_core::Blob::from(vec![1u8; bytes]),
            tag: None,
        };
        let req = RawRequest::call::<autograd_fns::echo_tensor, _>(&(fake,));
        let got = t.send_both::<autograd_fns::echo_tensor>(&req.frame(), req.id);
        for (kind, got) in ["control", "sync"].iter().zip(got) {
            let err = got
                .unwrap_or_else(|e| panic!("{dtype} {shape:?} over {kind}: connection ended: {e}"))
                .expect_err("a tensor whose shape exceeds its bytes was accepted");
            assert!(err.contains(says), "{dtype} {shape:?} over {kind}: {err}");
        }
    }
    t.survived("hostile tensors");
    t.finish();
}

#[test]
fn unauthenticated_connections_are_capped_and_dropped_fast() {
    let t = Target::start();
    let pid = t.pid();
    let before = open_fds(pid);
    // 300 connections that never say a word: each used to hold a descriptor for 10 s.
    let flood = t.rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..300 {
            if let Ok(c) = testing::dial_raw(&Transport::Tcp, &t.addr).await {
                v.push(c);
            }
        }
        v
    });
    std::thread::sleep(Duration::from_millis(500));
    let during = open_fds(pid);
    eprintln!("descriptors: {before} before, {during} with 300 silent connections");
    // At most 64 wait for their handshake; the rest are closed as they arrive.
    assert!(
        during <= before + 64 + 8,
        "{during} descriptors open (from {before})"
    );
    // The group's own connection keeps working meanwhile.
    t.healthy(7);
    // Those waiting are dropped after 3 s.
    let deadline = Instant::now() + Duration::from_secs(6);
    let mut after = open_fds(pid);
    while after > before + 4 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        after = open_fds(pid);
    }
    assert!(
        after <= before + 4,
        "{after} descriptors open 6 s after the flood (from {before})"
    );
    drop(flood);
    t.survived("300 unauthenticated connections");
    t.finish();
}

/// MUX-4: 800 calls of 1 MiB each on one connection, all to a function that holds its
/// arguments for 20 s, marked nested (depth 1) so that no admission permit holds them back:
/// the calls in flight stop at `max_in_flight_bytes` (256 MiB by default), the rest are refused
/// at once naming the limit, and the worker's peak RSS grows by less than that bound plus
/// 100 MB (it grew by the whole 800 MiB before the bound).
#[test]
fn a_flood_of_waiting_calls_is_refused_past_the_in_flight_bound() {
    let t = Target::start();
    const CALLS: u64 = 800;
    let refused = t.rt.block_on(async {
        let mut c = t.dial(false).await;
        let data = integration_tests::Bytes(vec![7u8; 1 << 20]);
        for id in 1..=CALLS {
            let mut req =
                RawRequest::call::<integration_tests::wait_holding, _>(&(data.clone(), 20_000u64));
            req.depth = 1;
            req.id = id;
            c.write_all(&req.frame()).await.unwrap();
        }
        c.flush().await.unwrap();
        testing::read_reply::<integration_tests::wait_holding>(
            &mut c,
            CALLS,
            Duration::from_secs(30),
        )
        .await
        .expect("the last call is answered at once")
        .expect_err("the last call is refused")
    });
    assert_eq!(refused.kind, rpc_core::RemoteErrorKind::Busy, "{refused}");
    assert!(
        refused.message.contains("max_in_flight_bytes = 268435456"),
        "{refused}"
    );
    t.survived_within("800 waiting calls of 1 MiB", MAX_GROWTH_KB + (256 << 10));
    t.finish();
}

/// MB-1, MB-2: rank 0 sends 64 tensors of 16 MiB under a tag the worker never receives, its
/// mailbox bounded at 64 MiB per sender: the fifth and later sends fail naming the worker and
/// the limit, the worker's peak RSS grows by less than the bound plus 100 MB (by the whole
/// 1 GiB before the bound), and once the messages are older than the mailbox keeps them they
/// are dropped.
#[test]
fn messages_nobody_receives_are_bounded() {
    let t = Target::start();
    let bound = 64 << 20;
    t.rt.block_on(
        t.agent
            .rpc_async(1u32, integration_tests::limit_mailbox, (bound, 600_000)),
    )
    .unwrap();
    let x = candle_core::Tensor::zeros(4 << 20, candle_core::DType::F32, &candle_core::Device::Cpu)
        .unwrap();
    let mut sent = 0;
    let mut refusal = None;
    for _ in 0..64 {
        match t.rt.block_on(collectives::send(&t.agent, 1u32, 99, &x)) {
            Ok(()) => sent += 1,
            Err(e) => refusal = Some(rpc_core::error_chain(&e)),
        }
    }
    assert_eq!(sent, 4, "64 MiB of 16 MiB messages");
    let refusal = refusal.expect("refused past the bound");
    assert!(
        refusal.contains("the mailbox of `worker1` refused a message from `worker0`")
            && refusal.contains("max_bytes_per_sender = 67108864"),
        "{refusal}"
    );
    let held =
        t.rt.block_on(t.agent.rpc_async(1u32, integration_tests::mailbox_held, ()));
    assert_eq!(held.unwrap(), (4, 64 << 20, 0));
    // The 64 MiB held, the refused message in flight (its frame and its tensor, 16 MiB each)
    // and what the allocator keeps of freed 16 MiB blocks: measured 133-199 MB of growth on the
    // 2-vCPU VM (199 in a CI run, past the earlier 164 MB limit); the unbounded mailbox this
    // guards against held all 64 messages, 1 GiB.
    t.survived_within(
        "64 unreceived messages of 16 MiB",
        MAX_GROWTH_KB + (128 << 10),
    );
    // Kept 300 ms from now on: what waits is dropped.
    t.rt.block_on(
        t.agent
            .rpc_async(1u32, integration_tests::limit_mailbox, (bound, 300)),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let held =
        t.rt.block_on(t.agent.rpc_async(1u32, integration_tests::mailbox_held, ()));
    assert_eq!(held.unwrap(), (0, 0, 4));
    t.finish();
}

// In process: a type whose own decoding panics, as a result and as an argument.

/// A value whose `Deserialize` panics on 13, the way a buggy or hostile type might.
#[derive(Debug, Serialize)]
struct Touchy(u32);

impl<'de> Deserialize<'de> for Touchy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = u32::deserialize(d)?;
        assert_ne!(v, 13, "unlucky number");
        Ok(Self(v))
    }
}

/// Returns `Touchy(v)`.
#[remote]
async fn make_touchy(_ctx: CallContext, v: u32) -> Result<Touchy, BoxError> {
    Ok(Touchy(v))
}

/// Takes a `Touchy`.
#[remote]
async fn take_touchy(_ctx: CallContext, t: Touchy) -> Result<u32, BoxError> {
    Ok(t.0)
}

#[test]
fn a_panicking_decoder_fails_the_call_not_the_caller() {
    integration_tests::run(60, async {
        let agents = testing::start_group(
            2,
            Transport::Tcp,
            Secret::generate(),
            |_| {
                Registry::builder()
                    .register(make_touchy)
                    .and_then(|b| b.register(take_touchy))
                    .and_then(|b| b.register(add))
                    .unwrap()
                    .build()
            },
            |_, c| c,
        )
        .await
        .unwrap();
        let a = &agents[0];
        assert_eq!(a.rpc_async(1u32, make_touchy, (12,)).await.unwrap().0, 12);
        // The reply's decoding panics on the caller.
        let e = a.rpc_async(1u32, make_touchy, (13,)).await.unwrap_err();
        assert!(rpc_core::error_chain(&e).contains("unlucky"), "{e:?}");
        // The same on a blocking call, off the runtime.
        let b = a.clone();
        let e = tokio::task::spawn_blocking(move || b.rpc_sync(1u32, make_touchy, (13,)))
            .await
            .unwrap()
            .unwrap_err();
        assert!(rpc_core::error_chain(&e).contains("unlucky"), "{e:?}");
        // The arguments' decoding panics on the callee: an error reply.
        let e = a
            .rpc_async(1u32, take_touchy, (Touchy(13),))
            .await
            .unwrap_err();
        assert!(rpc_core::error_chain(&e).contains("unlucky"), "{e:?}");
        // Both keep serving.
        assert_eq!(a.rpc_async(1u32, add, (2, 2)).await.unwrap(), 4);
        assert_eq!(agents[1].rpc_async(0u32, add, (3, 3)).await.unwrap(), 6);
        integration_tests::shutdown_all(&agents).await;
    });
}

// A man in the middle: frames injected after the handshake.

static NOTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Records `v` (a side effect an injected call would have).
#[remote]
async fn note(_ctx: CallContext, v: u32) -> Result<(), BoxError> {
    NOTED.store(v, std::sync::atomic::Ordering::SeqCst);
    Ok(())
}

/// Relays one connection to `upstream`, injecting `inject` into the client's bytes right
/// after its handshake message (86 bytes), as someone on the path between two hosts could.
async fn injecting_proxy(upstream: String, inject: Vec<u8>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let (client, _) = l.accept().await.unwrap();
        let server = tokio::net::TcpStream::connect(upstream).await.unwrap();
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut sr, &mut cw).await;
        });
        let mut hello = [0u8; 86];
        if cr.read_exact(&mut hello).await.is_ok() {
            sw.write_all(&hello).await.unwrap();
            sw.write_all(&inject).await.unwrap();
            let _ = tokio::io::copy(&mut cr, &mut sw).await;
        }
    });
    addr
}

#[test]
fn frames_injected_on_the_path_run_only_without_protection() {
    use rpc_core::WireProtection;
    use std::sync::atomic::Ordering;
    integration_tests::run(60, async {
        for (protection, value) in [
            (WireProtection::Off, 7),
            (WireProtection::Mac, 8),
            (WireProtection::Encrypt, 9),
        ] {
            let secret = Secret::generate();
            let agents = testing::start_group(
                2,
                Transport::Tcp,
                secret.clone(),
                |_| {
                    Registry::builder()
                        .register(note)
                        .and_then(|b| b.register(add))
                        .unwrap()
                        .build()
                },
                |_, c| c.with_wire_protection(protection),
            )
            .await
            .unwrap();
            // A well-formed call of `note`, as someone without the secret can write it.
            let mut injected = RawRequest::call::<note, _>(&(value,));
            injected.id = 99;
            let proxy = injecting_proxy(agents[1].local_addr().to_owned(), injected.frame()).await;
            let mut c = testing::dial_protected(&Transport::Tcp, &proxy, &secret, 0, protection)
                .await
                .unwrap();
            let req = RawRequest::call::<add, _>(&(1, 2));
            let _ = c.write_all(&req.frame()).await;
            let _ = c.flush().await;
            let got = testing::read_reply::<add>(&mut c, req.id, Duration::from_secs(5)).await;
            drop(c);
            let noted = NOTED.load(Ordering::SeqCst);
            match protection {
                WireProtection::Off => {
                    assert_eq!(got.unwrap().unwrap(), 3);
                    assert_eq!(
                        noted, value,
                        "the injected call ran (nothing protects the frames)"
                    );
                }
                _ => {
                    assert!(
                        got.is_err(),
                        "{protection:?}: the connection should have ended"
                    );
                    assert_ne!(noted, value, "{protection:?}: an injected call ran");
                }
            }
            // The worker goes on serving its group.
            assert_eq!(agents[0].rpc_async(1u32, add, (2, 2)).await.unwrap(), 4);
            integration_tests::shutdown_all(&agents).await;
        }
    });
}
