//! Entry points for coverage-guided fuzzing of what the network layer reads from a peer (the
//! `fuzz/` crate's targets call them; `cargo test` replays the seed corpus through them).
//! Each takes arbitrary bytes as they would arrive and must return without panicking,
//! hanging or allocating beyond the limits the layer promises; the differential ones also
//! check what they decode against what was sent.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_util::codec::Decoder;

use super::auth::{self, ConnKind, Secret};
use super::buffers::BufPool;
use super::frame::{self, FrameCodec, InMessage};
use super::seal::{Mode, Session, Transcript};
use super::shm::{Announce, Arena};
use super::transport::Conn;
use super::WireProtection;
use crate::wire::CallReply;
use crate::wire::CallRequest;

/// The frame limit the decoders run under here: small, so that frames above it are found.
const FUZZ_FRAME: usize = 64 << 10;

/// A connection that reads the fuzzer's bytes (in pieces of a chosen size, so partial reads
/// are exercised) and keeps what is written to it.
struct FuzzIo {
    data: Vec<u8>,
    at: usize,
    piece: usize,
    written: Arc<Mutex<Vec<u8>>>,
}

impl FuzzIo {
    fn new(data: &[u8], piece: usize) -> (Self, Arc<Mutex<Vec<u8>>>) {
        let written = Arc::default();
        let io = Self {
            data: data.to_vec(),
            at: 0,
            piece: piece.max(1),
            written: Arc::clone(&written),
        };
        (io, written)
    }
}

impl AsyncRead for FuzzIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = (self.data.len() - self.at)
            .min(self.piece)
            .min(buf.remaining());
        let at = self.at;
        buf.put_slice(&self.data[at..at + n]);
        self.at += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for FuzzIo {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        let mut w = self.written.lock().unwrap_or_else(|p| p.into_inner());
        // Bounded: what a target writes is checked, not kept without end.
        if w.len() < 16 << 20 {
            w.extend_from_slice(b);
        }
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Runs `f` on a runtime of this thread's own, within a bound (a target that waits past it
/// has hung: that is a finding, so it panics).
fn run<F: std::future::Future>(f: F) -> F::Output {
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
    }
    RT.with(|rt| {
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), f)
                .await
                .expect("a fuzz target hung")
        })
    })
}

/// The first byte picks the piece size the bytes after it arrive in.
fn split(data: &[u8]) -> (usize, &[u8]) {
    match data.split_first() {
        Some((&p, rest)) => (usize::from(p) * 97 + 1, rest),
        None => (1, data),
    }
}

/// Frames as they arrive on a connection: split off the byte stream (in pieces) under the
/// frame limit, each decoded as `T`.
fn frames<T: serde::de::DeserializeOwned>(data: &[u8], each: impl Fn(T)) {
    let (piece, data) = split(data);
    let mut codec = FrameCodec::new(FUZZ_FRAME);
    let mut buf = BytesMut::new();
    for chunk in data.chunks(piece) {
        buf.extend_from_slice(chunk);
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(f)) => {
                    if let Ok(m) = frame::decode::<T>(&f) {
                        each(m);
                    }
                }
                Ok(None) => break,
                // The connection ends here.
                Err(_) => return,
            }
        }
        assert!(
            buf.capacity() <= 2 * FUZZ_FRAME + piece + 4096,
            "a frame's buffer grew to {} bytes before its bytes arrived",
            buf.capacity()
        );
    }
}

/// Request frames, as a worker serving calls reads them.
pub fn request_frames(data: &[u8]) {
    frames::<InMessage<CallRequest>>(data, |m| {
        if let InMessage::Request(req) = m {
            let now = Instant::now();
            assert!(req.deadline(now) >= now);
            let _ = req.message.depth.saturating_add(1);
        }
    });
}

/// Reply frames, as a caller reads them.
pub fn reply_frames(data: &[u8]) {
    frames::<tarpc::Response<CallReply>>(data, |r| {
        if let Ok(Err(e)) = r.message {
            let _ = crate::RpcError::Remote(e).to_string();
        }
    });
}

/// The fuzzing arena's announcement: a real arena of this process (so that shared-blob
/// records can name ranges of a real mapping).
fn arena() -> Option<Announce> {
    static ARENA: OnceLock<Option<Arena>> = OnceLock::new();
    ARENA
        .get_or_init(|| Arena::create(1 << 20).ok())
        .as_ref()
        .map(Arena::announce)
}

/// A bulk connection's records, as the receiving worker reads them. The first byte picks
/// the piece size; if its low bit is set the records follow a real arena's announcement.
pub fn bulk_records(data: &[u8]) {
    let first = data.first().copied().unwrap_or(0);
    let (piece, rest) = split(data);
    let mut bytes = Vec::with_capacity(rest.len() + 40);
    if first & 1 == 1 {
        if let Some(a) = arena() {
            bytes.push(1);
            bytes.extend_from_slice(&a.encode());
        }
    }
    bytes.extend_from_slice(rest);
    let (io, _) = FuzzIo::new(&bytes, piece);
    let pool = BufPool::new(1 << 20);
    let got = Mutex::new(Vec::new());
    run(super::bulk_conn::serve(
        Box::new(io),
        1,
        FUZZ_FRAME,
        &pool,
        |id, b| got.lock().expect("not poisoned").push((id, b)),
    ));
    for (_, b) in got.into_inner().expect("not poisoned") {
        assert!(b.len() <= FUZZ_FRAME.max(1 << 20));
    }
}

fn secret() -> Secret {
    Secret::new(b"fuzzing secret, sixteen bytes or more")
}

fn protection(b: u8) -> WireProtection {
    match b % 4 {
        0 => WireProtection::Off,
        1 => WireProtection::Mac,
        2 => WireProtection::Encrypt,
        _ => WireProtection::Auto,
    }
}

/// The accepting side's handshake, reading a client's bytes.
pub fn handshake_server(data: &[u8]) {
    let (piece, rest) = split(data);
    let p = protection(data.first().copied().unwrap_or(0) / 97);
    let (io, written) = FuzzIo::new(rest, piece);
    let mut conn: Conn = Box::new(io);
    let me = auth::Ident {
        rank: 1,
        incarnation: 0,
    };
    let (gate, key) = (auth::Gate::default(), secret());
    let r = run(gate.handshake(&mut conn, &key, p, Duration::from_secs(1), me));
    // Without the secret's tag nobody is admitted.
    assert!(r.is_err(), "a forged handshake was accepted");
    assert!(written.lock().expect("not poisoned").len() <= 128);
}

/// The dialling side's handshake, reading a server's bytes.
pub fn handshake_client(data: &[u8]) {
    let (piece, rest) = split(data);
    let p = protection(data.first().copied().unwrap_or(0) / 97);
    let (io, _) = FuzzIo::new(rest, piece);
    let mut conn: Conn = Box::new(io);
    let r = run(auth::client(
        &mut conn,
        &secret(),
        p,
        ConnKind::Control,
        auth::Ident {
            rank: 3,
            incarnation: 0,
        },
        Some(auth::Ident {
            rank: 1,
            incarnation: 0,
        }),
    ));
    assert!(r.is_err(), "a forged server was believed");
}

/// The two ends of one protected connection's direction, as a handshake in `mode` leaves them.
fn sessions(mode: Mode) -> (Session, Session) {
    let s = secret();
    let t = Transcript {
        secret: s.bytes(),
        ns: &[1; 16],
        nc: &[2; 16],
        kind: ConnKind::Control as u8,
        rank: 1,
    };
    (
        Session::derive(&t, mode, true),
        Session::derive(&t, mode, false),
    )
}

/// Protected records, differentially: the input is a script of writes and flushes, sealed by
/// one end; then bytes of the sealed stream are altered, dropped, repeated or moved as the
/// script's tail says; the other end must hand on exactly the plaintext when nothing was
/// altered, and otherwise a prefix of it, never a byte that was not sent.
pub fn sealed_records(data: &[u8]) {
    let Some((&head, rest)) = data.split_first() else {
        return;
    };
    let mode = if head & 1 == 0 {
        Mode::Mac
    } else {
        Mode::Encrypt
    };
    let (script, edits) = rest.split_at(rest.len() / 2);
    let (client, server) = sessions(mode);
    // Write: each script byte is a write of that many bytes (a counter pattern), times 512
    // when odd (records are 64 KiB), then a flush when its top bit is set.
    let (io, wire) = FuzzIo::new(&[], 1);
    let mut w = client.wrap(Box::new(io));
    let mut sent = Vec::new();
    // Bytes that differ from their neighbours (a counter modulo a prime), sliced, not built
    // byte by byte (instrumented loops would be most of a run).
    static PATTERN: OnceLock<Vec<u8>> = OnceLock::new();
    let pattern = PATTERN.get_or_init(|| (0..251 + (64 << 10)).map(|i| (i % 251) as u8).collect());
    run(async {
        for &b in script {
            // Past a record and a part: a boundary is there to be crossed.
            if sent.len() > 96 << 10 {
                break;
            }
            let n = usize::from(b & 0x7f) * if b & 1 == 1 { 512 } else { 1 };
            let start = sent.len();
            sent.extend_from_slice(&pattern[start % 251..][..n]);
            w.write_all(&sent[start..]).await.expect("writes to memory");
            if b & 0x80 != 0 {
                w.flush().await.expect("flushes to memory");
            }
        }
        w.flush().await.expect("flushes to memory");
    });
    let sealed = std::mem::take(&mut *wire.lock().expect("not poisoned"));
    let mut stream = sealed.clone();
    // Edit: each 4 bytes are (op, position: u16, value); a few edits are enough to break any
    // record, and each costs a pass over the stream.
    for e in edits.chunks_exact(4).take(8) {
        if stream.is_empty() {
            break;
        }
        let at = usize::from(u16::from_le_bytes([e[1], e[2]])) % stream.len();
        match e[0] % 4 {
            0 => stream[at] ^= e[3].max(1),
            1 => {
                stream.remove(at);
            }
            2 => stream.insert(at, e[3]),
            _ => {
                let n = usize::from(e[3]).min(stream.len() - at);
                let moved: Vec<u8> = stream.drain(at..at + n).collect();
                let to = usize::from(e[3]) % (stream.len() + 1);
                stream.splice(to..to, moved);
            }
        }
    }
    let altered = stream != sealed;
    let (io, _) = FuzzIo::new(&stream, (usize::from(head) + 1) * 97);
    let mut r = server.wrap(Box::new(io));
    let mut got = Vec::new();
    let end = run(async {
        let mut buf = [0u8; 8192];
        loop {
            match r.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return Err(e),
            }
        }
    });
    assert!(
        sent.starts_with(&got),
        "the reader handed on {} bytes that were not sent",
        got.len()
    );
    if !altered {
        assert!(end.is_ok(), "an unaltered stream failed: {end:?}");
        assert_eq!(got.len(), sent.len(), "an unaltered stream lost bytes");
    }
}

/// Well-formed inputs for the targets of this module, by target: starting points for the
/// fuzzer (it mutates them) and for the replay test.
pub(crate) fn seeds() -> Vec<(&'static str, Vec<Vec<u8>>)> {
    use crate::wire::{CallMeta, CallOk, KeepTarget, WireBlob};
    let frame = |msgs: &[&dyn Fn(&mut BytesMut)]| {
        let mut buf = BytesMut::new();
        for m in msgs {
            m(&mut buf);
        }
        let mut out = vec![7];
        out.extend_from_slice(&buf);
        out
    };
    let request = |id: u64, keep: bool| {
        move |buf: &mut BytesMut| {
            let req = CallRequest {
                fn_name: "echo".into(),
                sig: 0x1234_5678_9abc_def0,
                depth: 2,
                payload: vec![1, 2, 3, 4],
                blobs: vec![
                    WireBlob::Inline(vec![9; 40]),
                    WireBlob::Bulk {
                        id: 5,
                        len: 1 << 20,
                    },
                ],
                keep: keep.then(|| KeepTarget {
                    sink: "rref".into(),
                    token: vec![0; 16],
                }),
                meta: CallMeta::default().with("autograd", vec![1; 16]),
                cancel_id: Some(id),
                trace: None,
            };
            let msg = tarpc::ClientMessage::Request(tarpc::Request {
                context: frame::request_context(Instant::now() + Duration::from_secs(30)),
                id,
                message: req,
            });
            frame::encode(buf, &msg, usize::MAX).expect("encodes");
        }
    };
    let cancel = |buf: &mut BytesMut| {
        let msg = tarpc::ClientMessage::<CallRequest>::Cancel {
            trace_context: tarpc::context::current().trace_context,
            request_id: 3,
        };
        frame::encode(buf, &msg, usize::MAX).expect("encodes");
    };
    let reply = |ok: bool| {
        move |buf: &mut BytesMut| {
            let message: CallReply = if ok {
                Ok(CallOk {
                    payload: vec![1; 24],
                    blobs: vec![
                        WireBlob::Inline(vec![2; 8]),
                        WireBlob::Bulk { id: 9, len: 4096 },
                    ],
                })
            } else {
                Err(crate::RemoteError::new_protocol(
                    "echo",
                    "worker1",
                    "bad token",
                ))
            };
            let msg = tarpc::Response {
                request_id: 4,
                message: Ok(message),
            };
            frame::encode(buf, &msg, usize::MAX).expect("encodes");
        }
    };
    let stream = |id: u64, body: &[u8]| {
        let mut r = vec![0];
        r.extend_from_slice(&id.to_le_bytes());
        r.extend_from_slice(&(body.len() as u64).to_le_bytes());
        r.extend_from_slice(body);
        r
    };
    let shared = |id: u64, len: u64, off: u64| {
        let mut r = vec![2];
        for n in [id, len, off] {
            r.extend_from_slice(&n.to_le_bytes());
        }
        r
    };
    let mut bulk_plain = vec![8];
    bulk_plain.extend(stream(1, &[5; 300]));
    bulk_plain.extend(stream(2, &[]));
    let mut bulk_arena = vec![9];
    bulk_arena.extend(shared(3, 100, 4096));
    bulk_arena.extend(shared(4, 8192, 8192));
    bulk_arena.extend(stream(5, &[1; 10]));
    // A client's message with a wrong tag, and a server's hello, status and tag.
    let mut client_msg = vec![0, 0];
    client_msg.extend_from_slice(b"RXRPC\0v2");
    client_msg.extend_from_slice(&[1, 3, 0, 0, 0, 1]);
    client_msg.extend_from_slice(&[0x5a; 16 + 32]);
    let mut server_msg = vec![0, 1];
    server_msg.extend_from_slice(b"RXRPC\0v2");
    server_msg.extend_from_slice(&[0xa5; 16]);
    server_msg.extend_from_slice(&[1, 1]);
    server_msg.extend_from_slice(&[0x3c; 32]);
    vec![
        (
            "request",
            vec![
                frame(&[&request(1, false)]),
                frame(&[&request(2, true), &cancel, &request(3, false)]),
            ],
        ),
        ("reply", vec![frame(&[&reply(true), &reply(false)])]),
        ("bulk", vec![bulk_plain, bulk_arena]),
        ("handshake_server", vec![client_msg]),
        ("handshake_client", vec![server_msg]),
        (
            "sealed",
            vec![
                vec![0, 10, 0x81, 3, 200, 7, 0, 0, 0, 0],
                vec![1, 0x7f, 0xff, 5, 0x80, 0, 9, 0, 1, 2, 3, 4],
                vec![0, 130, 3, 255, 1, 1, 0, 0, 0, 1, 5, 0, 0],
            ],
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn seeds_are_well_formed() {
        let all: std::collections::HashMap<_, _> = seeds().into_iter().collect();
        let count = |target: &str, decode: &dyn Fn(&[u8]) -> usize| -> Vec<usize> {
            all[target].iter().map(|s| decode(s)).collect()
        };
        let n = Cell::new(0);
        let requests = count("request", &|s| {
            n.set(0);
            frames::<InMessage<CallRequest>>(s, |_| n.set(n.get() + 1));
            n.get()
        });
        assert_eq!(requests, [1, 3]);
        let replies = count("reply", &|s| {
            n.set(0);
            frames::<tarpc::Response<CallReply>>(s, |_| n.set(n.get() + 1));
            n.get()
        });
        assert_eq!(replies, [2]);
    }
}
