//! Parts of every node handed to node 0's launcher however the job ended (TR-9).
//!
//! TR-8 sends a worker's part to rank 0 at a clean shutdown only. A worker that ends otherwise
//! (its program failed, its launcher stopped it after a failure elsewhere) writes its part
//! where it runs (TR-5), and node 0's merge would lack it. So node 0's launcher listens on a
//! [`PartSink`] for the whole job and names it to its processes ([`TRACE_SINK_ENV`]); rank 0's
//! rendezvous names it to every member, each part records it, and every other node's launcher,
//! once its processes have ended, sends the parts it finds to the sink that its newest part
//! names ([`send_parts`]). Node 0's launcher waits, bounded, for every other node before it
//! merges.
//!
//! The exchange, on one TCP connection, proves the group's secret both ways before a file is
//! taken, and each file carries a tag over its name and bytes:
//!
//! 1. sink → sender: `MAGIC`, a 32-byte nonce `ns`;
//! 2. sender → sink: `MAGIC`, a nonce `nc`, `HMAC(secret, "parts-sender" | ns | nc)`;
//! 3. sink → sender: `1`, `HMAC(secret, "parts-sink" | nc | ns)` if the tag verifies, else `0`
//!    and the connection closes;
//! 4. per file: name length (u16 LE, 1 to [`MAX_NAME`]), the name, length (u64 LE, at most
//!    [`MAX_PART`]), the bytes, `HMAC(secret, "part" | ns | nc | name | bytes)`; then a zero
//!    length and the sender's name (u16 LE length, text);
//! 5. sink → sender: how many files it wrote (u32 LE) and how many it refused (u32 LE).
//!
//! A file is written (whole or not at all) only under a part's name (`rank-R-inc-I.json`,
//! `rank-R-inc-I-restart-K.json`), into the sink's parts directory. Every read and write is
//! bounded ([`IO_TIMEOUT`]); at most [`MAX_SENDERS`] connections are served at once.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use hmac::Mac;

use super::chrome::{parts_dir, write_bytes_atomic};
use crate::net::auth::fill_random;
use crate::Secret;

/// The environment variable naming node 0's sink (`host:port`) to the processes its launcher
/// starts; rank 0's rendezvous names it to the others.
pub const TRACE_SINK_ENV: &str = "RPC_TRACE_SINK";

const MAGIC: &[u8; 8] = b"RXPARTS1";
const NONCE: usize = 32;
const TAG: usize = 32;
/// The longest file name taken.
pub(crate) const MAX_NAME: usize = 128;
/// The largest part taken (a full ring of 262,144 events is about 40 MB of JSON).
pub(crate) const MAX_PART: u64 = 1 << 30;
/// The bound on every read and write of the exchange.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more are closed at once.
pub(crate) const MAX_SENDERS: usize = 16;

/// What a sink has been given so far.
#[derive(Default)]
struct Received {
    /// The senders that completed an exchange.
    senders: BTreeSet<String>,
    files: usize,
}

/// Node 0's launcher's listener for the other nodes' parts (see the module's documentation):
/// served on a thread of its own until dropped.
pub struct PartSink {
    addr: SocketAddr,
    received: Arc<(Mutex<Received>, Condvar)>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for PartSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartSink")
            .field("addr", &self.addr)
            .finish()
    }
}

impl PartSink {
    /// Listens on `bind` (`host:port`; port 0 for a free one) for the parts of the job traced
    /// to `trace`, written into `trace`'s parts directory; senders must hold `secret`.
    pub fn start(bind: &str, secret: Secret, trace: &Path) -> std::io::Result<PartSink> {
        let listener = TcpListener::bind(bind)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let received = Arc::new((Mutex::new(Received::default()), Condvar::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let dir = parts_dir(trace);
        let (r, s) = (Arc::clone(&received), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("trace-sink".into())
            .spawn(move || accept_loop(listener, secret, dir, r, s))?;
        Ok(PartSink {
            addr,
            received,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until `senders` different senders have completed an exchange, or `bound` has
    /// passed; returns the senders heard from, by name.
    pub fn wait_for(&self, senders: usize, bound: Duration) -> Vec<String> {
        let (lock, cv) = &*self.received;
        let got = lock.lock().unwrap_or_else(|p| p.into_inner());
        let (got, _) = cv
            .wait_timeout_while(got, bound, |r| r.senders.len() < senders)
            .unwrap_or_else(|p| p.into_inner());
        got.senders.iter().cloned().collect()
    }

    /// Files written so far.
    pub fn files(&self) -> usize {
        let (lock, _) = &*self.received;
        lock.lock().unwrap_or_else(|p| p.into_inner()).files
    }
}

impl Drop for PartSink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    secret: Secret,
    dir: PathBuf,
    received: Arc<(Mutex<Received>, Condvar)>,
    stop: Arc<AtomicBool>,
) {
    let active = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::SeqCst) {
        let conn = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            Err(e) => {
                tracing::warn!(cause = %e, "trace sink: accept failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_SENDERS {
            active.fetch_sub(1, Ordering::SeqCst);
            continue; // dropped: closed
        }
        let (secret, dir, received, slot) = (
            secret.clone(),
            dir.clone(),
            Arc::clone(&received),
            Arc::clone(&active),
        );
        let served = std::thread::Builder::new()
            .name("trace-sink-conn".into())
            .spawn(move || {
                let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                match serve(conn, &secret, &dir) {
                    Ok((from, written, refused)) => {
                        tracing::info!(%from, %peer, written, refused, "trace parts received");
                        let (lock, cv) = &*received;
                        let mut r = lock.lock().unwrap_or_else(|p| p.into_inner());
                        r.senders.insert(from);
                        r.files += written;
                        cv.notify_all();
                    }
                    Err(e) => tracing::warn!(%peer, cause = %e, "trace sink: parts refused"),
                }
                slot.fetch_sub(1, Ordering::SeqCst);
            });
        if served.is_err() {
            active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("trace sink: no thread for a sender");
        }
    }
}

fn bad(why: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, why.into())
}

/// One sender's exchange: its name, the files written and the files refused.
fn serve(
    mut conn: TcpStream,
    secret: &Secret,
    dir: &Path,
) -> std::io::Result<(String, usize, usize)> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut ns = [0u8; NONCE];
    fill_random(&mut ns);
    conn.write_all(&[&MAGIC[..], &ns].concat())?;
    let mut msg = [0u8; 8 + NONCE + TAG];
    conn.read_exact(&mut msg)?;
    let nc: [u8; NONCE] = msg[8..8 + NONCE].try_into().expect("32 bytes");
    let ok = &msg[..8] == MAGIC
        && (secret.mac(&[b"parts-sender", &ns, &nc]))
            .verify_slice(&msg[8 + NONCE..])
            .is_ok();
    if !ok {
        conn.write_all(&[0])?;
        return Err(bad("the sender does not hold the group's secret"));
    }
    let tag = secret
        .mac(&[b"parts-sink", &nc, &ns])
        .finalize()
        .into_bytes();
    conn.write_all(&[&[1u8][..], &tag].concat())?;
    let (mut written, mut refused) = (0, 0);
    let from = loop {
        let name = read_text(&mut conn)?;
        if name.is_empty() {
            break read_text(&mut conn)?;
        }
        let mut len = [0u8; 8];
        conn.read_exact(&mut len)?;
        let len = u64::from_le_bytes(len);
        if len > MAX_PART {
            return Err(bad(format!("{name}: {len} bytes, over {MAX_PART}")));
        }
        let mut bytes = vec![0u8; len as usize];
        conn.read_exact(&mut bytes)?;
        let mut tag = [0u8; TAG];
        conn.read_exact(&mut tag)?;
        let mac = secret.mac(&[b"part", &ns, &nc, name.as_bytes(), &bytes]);
        if mac.verify_slice(&tag).is_err() {
            return Err(bad(format!("{name}: its tag does not verify")));
        }
        if !is_part_name(&name) {
            tracing::warn!(%name, "trace sink: not a part's name; not written");
            refused += 1;
            continue;
        }
        write_bytes_atomic(&dir.join(&name), &bytes)?;
        written += 1;
    };
    let counts = [
        (written as u32).to_le_bytes(),
        (refused as u32).to_le_bytes(),
    ]
    .concat();
    conn.write_all(&counts)?;
    Ok((from, written, refused))
}

/// A length-prefixed (u16 LE) text of at most [`MAX_NAME`] bytes.
fn read_text(conn: &mut TcpStream) -> std::io::Result<String> {
    let mut len = [0u8; 2];
    conn.read_exact(&mut len)?;
    let len = usize::from(u16::from_le_bytes(len));
    if len > MAX_NAME {
        return Err(bad(format!("a name of {len} bytes, over {MAX_NAME}")));
    }
    let mut b = vec![0u8; len];
    conn.read_exact(&mut b)?;
    String::from_utf8(b).map_err(|_| bad("a name that is not UTF-8"))
}

/// `rank-R-inc-I.json` or `rank-R-inc-I-restart-K.json`, numbers in decimal: nothing else is
/// written (no path, no other file).
pub(crate) fn is_part_name(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".json") else {
        return false;
    };
    let f: Vec<&str> = stem.split('-').collect();
    let num = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    match f.as_slice() {
        ["rank", r, "inc", i] => num(r) && num(i),
        ["rank", r, "inc", i, "restart", k] => num(r) && num(i) && num(k),
        _ => false,
    }
}

/// What [`send_parts`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SentParts {
    /// The sink they went to.
    pub sink: String,
    /// Files the sink wrote.
    pub written: usize,
    /// Files it refused (not named as parts).
    pub refused: usize,
}

/// Why [`send_parts`] sent nothing, or not everything.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SendPartsError {
    /// No part of this job here names node 0's sink (no part was written, or the job's
    /// processes were started without one).
    #[error("no trace part in {0} names node 0's sink")]
    NoSink(PathBuf),
    /// The parts could not be read.
    #[error("reading the trace parts: {0}")]
    Parts(#[from] super::MergeError),
    /// The sink could not be reached, or the exchange failed.
    #[error("sending the trace parts to {sink}: {source}")]
    Io {
        /// The sink's address.
        sink: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// Sends the parts of the job traced to `trace` found here (those of the job that wrote the
/// newest part) to `sink`, or where none is given to the sink they name, as `from` (with no
/// part, `from` still says it has none); the connection is tried again until `bound` has
/// passed (the sink's host may be slow to answer), each read and write bounded (10 s).
pub fn send_parts(
    trace: &Path,
    sink: Option<&str>,
    from: &str,
    secret: &Secret,
    bound: Duration,
) -> Result<SentParts, SendPartsError> {
    let (files, named) = match super::merge::this_jobs_parts(trace) {
        Ok(found) => found,
        // No parts' directory here: nothing to send, but a sink given hears that.
        Err(super::MergeError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound && sink.is_some() =>
        {
            (Vec::new(), None)
        }
        Err(e) => return Err(e.into()),
    };
    let sink = (sink.map(str::to_owned).or(named))
        .ok_or_else(|| SendPartsError::NoSink(parts_dir(trace)))?;
    let io = |source| SendPartsError::Io {
        sink: sink.clone(),
        source,
    };
    let deadline = Instant::now() + bound;
    let mut conn = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match connect(&sink, left.max(Duration::from_millis(100))) {
            Ok(c) => break c,
            Err(e) if Instant::now() + Duration::from_millis(250) >= deadline => return Err(io(e)),
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    };
    let (written, refused) = exchange(&mut conn, secret, &files, from).map_err(io)?;
    Ok(SentParts {
        sink,
        written,
        refused,
    })
}

/// A connection to `sink`, tried for at most `within` (and [`IO_TIMEOUT`]).
fn connect(sink: &str, within: Duration) -> std::io::Result<TcpStream> {
    let addr = (sink.to_socket_addrs()?.next())
        .ok_or_else(|| std::io::Error::other(format!("{sink} names no address")))?;
    let conn = TcpStream::connect_timeout(&addr, within.min(IO_TIMEOUT))?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(conn)
}

/// The sender's side: proves the secret, checks the sink's proof, sends `files` and `from`.
fn exchange(
    conn: &mut TcpStream,
    secret: &Secret,
    files: &[PathBuf],
    from: &str,
) -> std::io::Result<(usize, usize)> {
    let mut hello = [0u8; 8 + NONCE];
    conn.read_exact(&mut hello)?;
    if &hello[..8] != MAGIC {
        return Err(bad("the address is not a trace sink"));
    }
    let ns = &hello[8..];
    let mut nc = [0u8; NONCE];
    fill_random(&mut nc);
    let tag = secret
        .mac(&[b"parts-sender", ns, &nc])
        .finalize()
        .into_bytes();
    conn.write_all(&[&MAGIC[..], &nc, &tag].concat())?;
    let mut answer = [0u8; 1 + TAG];
    conn.read_exact(&mut answer[..1])
        .map_err(|_| bad("the sink refused this node's secret"))?;
    if answer[0] != 1 {
        return Err(bad("the sink refused this node's secret"));
    }
    conn.read_exact(&mut answer[1..])?;
    if (secret.mac(&[b"parts-sink", &nc, ns]))
        .verify_slice(&answer[1..])
        .is_err()
    {
        return Err(bad("the sink does not hold the group's secret"));
    }
    let text = |t: &str| [&(t.len() as u16).to_le_bytes()[..], t.as_bytes()].concat();
    for f in files {
        let Some(name) = f.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let bytes = std::fs::read(f)?;
        let tag = (secret.mac(&[b"part", ns, &nc, name.as_bytes(), &bytes]))
            .finalize()
            .into_bytes();
        conn.write_all(&text(name))?;
        conn.write_all(&(bytes.len() as u64).to_le_bytes())?;
        conn.write_all(&bytes)?;
        conn.write_all(&tag)?;
    }
    let mut end = from.len().min(MAX_NAME);
    while !from.is_char_boundary(end) {
        end -= 1;
    }
    let from = &from[..end];
    conn.write_all(&[text(""), text(from)].concat())?;
    let mut counts = [0u8; 8];
    conn.read_exact(&mut counts)?;
    let n = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize;
    Ok((n(&counts[..4]), n(&counts[4..])))
}

#[cfg(test)]
mod tests;
