//! The blocking connection's frames: the same frames as the multiplexed connection's
//! (encoded and decoded by the parent module), on a blocking TCP stream, sealed as a whole
//! frame at a time when the connection is protected.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::super::failure::CallFailed;
use super::super::seal::{Keys, Opener, Sealer};
use super::{decode, encode, KEEP_BUFFER, READ_CHUNK};

/// The longest a blocking read or write waits before checking the deadline and whether the
/// worker closed.
const SLICE: Duration = Duration::from_millis(200);

/// A blocking connection's receive buffer; it grows for larger frames, and goes back to this
/// size once a frame above `KEEP_BUFFER` has been consumed (send buffers likewise).
const READ_BUFFER: usize = 16 << 10;

/// The part of `deadline` left, at least a millisecond (a zero socket timeout means none).
pub(crate) fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// Frames on a blocking TCP stream. Socket timeouts are `SLICE` (shorter only near a
/// deadline), so a wait wakes up to check its deadline and `closed` without a system call per
/// frame to set them. With keys, the frames travel in records (`seal/`): each frame sent is
/// sealed as a whole, and frames are read from records once they have been checked.
pub(crate) struct BlockingFrames {
    stream: TcpStream,
    max: usize,
    /// Received bytes not yet consumed: `rbuf[rpos..rend]`.
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    wbuf: BytesMut,
    sealed: Option<Sealed>,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    /// How long a read polls the socket before it blocks ([`crate::Config::busy_poll`]).
    spin: Duration,
}

/// A protected blocking connection's keys and buffers.
struct Sealed {
    sealer: Sealer,
    opener: Opener,
    /// The frame being sent, sealed.
    out: Vec<u8>,
    /// Checked bytes not yet consumed: `plain[ppos..]`.
    plain: Vec<u8>,
    ppos: usize,
}

impl BlockingFrames {
    /// Frames of at most `max` bytes on `stream` (in records sealed with `keys`, if given),
    /// whose socket timeouts are unknown (they are set before the first wait).
    pub(crate) fn new(stream: TcpStream, keys: Option<Keys>, max: usize, spin: Duration) -> Self {
        Self {
            stream,
            max,
            rbuf: vec![0; READ_BUFFER],
            rpos: 0,
            rend: 0,
            wbuf: BytesMut::new(),
            sealed: keys.map(|(sealer, opener)| Sealed {
                sealer,
                opener,
                out: Vec::new(),
                plain: Vec::new(),
                ppos: 0,
            }),
            read_timeout: Some(Duration::ZERO),
            write_timeout: Some(Duration::ZERO),
            spin,
        }
    }

    /// The timeout for the next wait; `Err` once the deadline has passed.
    fn slice(deadline: Option<Instant>) -> Result<Duration, CallFailed> {
        match deadline {
            Some(d) if Instant::now() >= d => Err(CallFailed::Deadline),
            Some(d) => Ok(left(d).min(SLICE)),
            None => Ok(SLICE),
        }
    }

    /// Writes `msg` as one frame by `deadline`; `closed` is checked whenever a wait times out.
    pub(crate) fn send<T: Serialize>(
        &mut self,
        msg: &T,
        deadline: Option<Instant>,
        closed: &dyn Fn() -> bool,
    ) -> Result<(), CallFailed> {
        self.wbuf.clear();
        encode(&mut self.wbuf, msg, self.max).map_err(|cause| CallFailed::NotSent {
            cause,
            broken: false,
        })?;
        let bytes: &[u8] = match &mut self.sealed {
            None => &self.wbuf,
            Some(s) => {
                s.out.clear();
                s.sealer.seal_into(&self.wbuf, &mut s.out);
                &s.out
            }
        };
        let mut done = 0;
        while done < bytes.len() {
            let t = Some(Self::slice(deadline)?);
            if self.write_timeout != t {
                self.stream
                    .set_write_timeout(t)
                    .map_err(|cause| CallFailed::NotSent {
                        cause,
                        broken: true,
                    })?;
                self.write_timeout = t;
            }
            match self.stream.write(&bytes[done..]) {
                Ok(0) => {
                    let e = io::Error::new(io::ErrorKind::WriteZero, "connection closed");
                    return Err(if done == 0 {
                        CallFailed::NotSent {
                            cause: e,
                            broken: true,
                        }
                    } else {
                        CallFailed::Lost(e)
                    });
                }
                Ok(n) => done += n,
                Err(e) if is_timeout(&e) => {
                    if closed() {
                        return Err(CallFailed::Closed);
                    }
                }
                Err(cause) if done == 0 => {
                    return Err(CallFailed::NotSent {
                        cause,
                        broken: true,
                    })
                }
                Err(e) => return Err(CallFailed::Lost(e)),
            }
        }
        if self.wbuf.capacity() > KEEP_BUFFER {
            self.wbuf = BytesMut::new();
        }
        if let Some(s) = &mut self.sealed {
            if s.out.capacity() > KEEP_BUFFER {
                s.out = Vec::new();
            }
        }
        Ok(())
    }

    /// Receives one frame by `deadline`; `closed` is checked whenever a wait times out.
    pub(crate) fn recv<T: DeserializeOwned>(
        &mut self,
        deadline: Option<Instant>,
        closed: &dyn Fn() -> bool,
    ) -> Result<T, CallFailed> {
        self.fill_plain(4, deadline, closed)?;
        let head: [u8; 4] = self.plain()[..4].try_into().expect("4 bytes");
        let len = u32::from_be_bytes(head) as usize;
        if len > self.max {
            return Err(CallFailed::Lost(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("frame of {len} bytes is above the limit of {}", self.max),
            )));
        }
        self.fill_plain(4 + len, deadline, closed)?;
        let msg = decode(&self.plain()[4..4 + len]).map_err(CallFailed::Lost);
        match &mut self.sealed {
            None => self.rpos += 4 + len,
            Some(s) => {
                s.ppos += 4 + len;
                if s.ppos == s.plain.len() {
                    s.plain.clear();
                    s.ppos = 0;
                    if s.plain.capacity() > KEEP_BUFFER {
                        s.plain = Vec::new();
                    }
                }
            }
        }
        // A connection that once carried a large frame does not keep its buffer.
        if self.rpos == self.rend && self.rbuf.len() > KEEP_BUFFER {
            self.rbuf = vec![0; READ_BUFFER];
            (self.rpos, self.rend) = (0, 0);
        }
        msg
    }

    /// The bytes of frames received and not yet consumed (checked ones, with keys).
    fn plain(&self) -> &[u8] {
        match &self.sealed {
            None => &self.rbuf[self.rpos..self.rend],
            Some(s) => &s.plain[s.ppos..],
        }
    }

    /// Ensures `n` bytes of frames are ready in [`plain`](Self::plain): with keys, opens
    /// records as they arrive until they are (SEAL-1).
    fn fill_plain(
        &mut self,
        n: usize,
        deadline: Option<Instant>,
        closed: &dyn Fn() -> bool,
    ) -> Result<(), CallFailed> {
        if self.sealed.is_none() {
            return self.fill(n, deadline, closed);
        }
        while self.plain().len() < n {
            self.fill(4, deadline, closed)?;
            let s = self.sealed.as_ref().expect("keys");
            let total = s
                .opener
                .record_len(&self.rbuf[self.rpos..self.rend])
                .map_err(CallFailed::Lost)?
                .expect("a header is buffered");
            self.fill(total, deadline, closed)?;
            let s = self.sealed.as_mut().expect("keys");
            let rec = &mut self.rbuf[self.rpos..self.rpos + total];
            let body = s.opener.open(rec).map_err(CallFailed::Lost)?;
            if s.ppos > 0 {
                s.plain.drain(..s.ppos);
                s.ppos = 0;
            }
            s.plain.extend_from_slice(&rec[body]);
            self.rpos += total;
        }
        Ok(())
    }

    /// Ensures `n` unconsumed bytes are buffered.
    fn fill(
        &mut self,
        n: usize,
        deadline: Option<Instant>,
        closed: &dyn Fn() -> bool,
    ) -> Result<(), CallFailed> {
        if self.rend - self.rpos >= n {
            return Ok(());
        }
        // Move what is left to the front; room for `n` is made as the bytes arrive (FRAME-4).
        self.rbuf.copy_within(self.rpos..self.rend, 0);
        self.rend -= self.rpos;
        self.rpos = 0;
        self.grow(n);
        self.poll_for(n)?;
        while self.rend < n {
            self.grow(n);
            let t = Some(Self::slice(deadline)?);
            if self.read_timeout != t {
                self.stream.set_read_timeout(t).map_err(CallFailed::Lost)?;
                self.read_timeout = t;
            }
            match self.stream.read(&mut self.rbuf[self.rend..]) {
                Ok(0) => return Err(CallFailed::Lost(eof())),
                Ok(k) => self.rend += k,
                Err(e) if is_timeout(&e) => {
                    if closed() {
                        return Err(CallFailed::Closed);
                    }
                }
                Err(e) => return Err(CallFailed::Lost(e)),
            }
        }
        Ok(())
    }

    /// Room for the next bytes of a frame that needs `n` buffered: at most `READ_CHUNK` more
    /// than has arrived.
    fn grow(&mut self, n: usize) {
        let want = n.min(self.rend + READ_CHUNK).max(READ_BUFFER);
        if self.rbuf.len() < want {
            self.rbuf.resize(want, 0);
        }
    }

    /// Reads without blocking until `n` bytes are buffered or `spin` has passed, giving way
    /// to any other thread runnable on this core between tries: a reply that comes within
    /// the window is read by a thread that never slept, so the sender wakes nobody.
    fn poll_for(&mut self, n: usize) -> Result<(), CallFailed> {
        if self.spin.is_zero() {
            return Ok(());
        }
        let until = Instant::now() + self.spin;
        while self.rend < n {
            self.grow(n);
            match rustix::net::recv(
                &self.stream,
                &mut self.rbuf[self.rend..],
                rustix::net::RecvFlags::DONTWAIT,
            ) {
                Ok((0, _)) => return Err(CallFailed::Lost(eof())),
                Ok((k, _)) => self.rend += k,
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {
                    if Instant::now() >= until {
                        return Ok(());
                    }
                    std::thread::yield_now();
                }
                Err(e) => return Err(CallFailed::Lost(e.into())),
            }
        }
        Ok(())
    }
}

fn eof() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the peer closed the connection",
    )
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}
