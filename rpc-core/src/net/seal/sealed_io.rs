//! An async connection protected as its handshake agreed: bytes written are sealed into
//! records, bytes read are handed on once their record has been checked.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::super::transport::Conn;
use super::{Opener, Sealer, HEADER, HIGH_WATER, MAX_TAG, READ_ROOM, RECORD};

/// An async connection whose bytes travel as records (see the module docs). Bytes written
/// go out when a record fills or on flush; bytes read are handed on once their record has
/// been checked.
pub(crate) struct SealedIo {
    inner: Conn,
    sealer: Sealer,
    opener: Opener,
    /// Sealed records not yet written, `out[out_pos..open_at]`, then the record being filled
    /// (`out[open_at..]`: header room and body so far), if any.
    out: Vec<u8>,
    out_pos: usize,
    open_at: Option<usize>,
    /// Received bytes: `rbuf[rpos..rend]`, a record at `rpos` once complete.
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    /// The checked plaintext not yet handed on, within `rbuf`, and where its record ends.
    plain: Range<usize>,
    plain_rec_end: usize,
}

impl SealedIo {
    pub(super) fn new(inner: Conn, sealer: Sealer, opener: Opener) -> Self {
        Self {
            inner,
            sealer,
            opener,
            out: Vec::new(),
            out_pos: 0,
            open_at: None,
            rbuf: Vec::new(),
            rpos: 0,
            rend: 0,
            plain: 0..0,
            plain_rec_end: 0,
        }
    }

    /// Sealed bytes not yet written.
    fn sealed_pending(&self) -> usize {
        self.open_at.unwrap_or(self.out.len()) - self.out_pos
    }

    /// Writes sealed bytes until at most `limit` are left.
    fn poll_drain(&mut self, cx: &mut Context<'_>, limit: usize) -> Poll<io::Result<()>> {
        while self.sealed_pending() > limit {
            let end = self.open_at.unwrap_or(self.out.len());
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.out[self.out_pos..end]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.out_pos += n;
        }
        if self.out_pos > 0 && self.sealed_pending() == 0 {
            // Everything sealed is out: the record being filled moves to the front.
            self.out.drain(..self.out_pos);
            if let Some(at) = &mut self.open_at {
                *at -= self.out_pos;
            }
            self.out_pos = 0;
        }
        Poll::Ready(Ok(()))
    }

    fn seal_open(&mut self) {
        if let Some(at) = self.open_at.take() {
            if self.out.len() == at + HEADER {
                self.out.truncate(at);
            } else {
                self.sealer.seal_tail(&mut self.out, at);
            }
        }
    }
}

impl AsyncWrite for SealedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if this.sealed_pending() >= HIGH_WATER {
            ready!(this.poll_drain(cx, HIGH_WATER - 1))?;
        }
        let at = *this.open_at.get_or_insert_with(|| {
            this.out.extend_from_slice(&[0; HEADER]);
            this.out.len() - HEADER
        });
        let filled = this.out.len() - at - HEADER;
        let n = (RECORD - filled).min(buf.len());
        this.out.extend_from_slice(&buf[..n]);
        if filled + n == RECORD {
            this.seal_open();
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.seal_open();
        ready!(this.poll_drain(cx, 0))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.as_mut().poll_flush(cx))?;
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl AsyncRead for SealedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.plain.is_empty() {
                let n = this.plain.len().min(buf.remaining());
                buf.put_slice(&this.rbuf[this.plain.start..this.plain.start + n]);
                this.plain.start += n;
                if this.plain.is_empty() {
                    this.rpos = this.plain_rec_end;
                }
                return Poll::Ready(Ok(()));
            }
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let have = &mut this.rbuf[this.rpos..this.rend];
            if let Some(len) = this.opener.record_len(have)? {
                if have.len() >= len {
                    let body = this.opener.open(&mut have[..len])?;
                    this.plain = this.rpos + body.start..this.rpos + body.end;
                    this.plain_rec_end = this.rpos + len;
                    if this.plain.is_empty() {
                        this.rpos = this.plain_rec_end;
                    }
                    continue;
                }
            }
            // More bytes are needed: make room for a whole record after `rpos` (SEAL-2: at
            // most the largest record's worth).
            if this.rbuf.is_empty() {
                this.rbuf = vec![0; READ_ROOM];
            }
            if this.rpos == this.rend {
                (this.rpos, this.rend) = (0, 0);
            } else if this.rbuf.len() - this.rpos < HEADER + RECORD + MAX_TAG {
                this.rbuf.copy_within(this.rpos..this.rend, 0);
                this.rend -= this.rpos;
                this.rpos = 0;
            }
            let mut rb = ReadBuf::new(&mut this.rbuf[this.rend..]);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == 0 {
                return Poll::Ready(if this.rpos == this.rend {
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the connection ended inside a record",
                    ))
                });
            }
            this.rend += n;
        }
    }
}
