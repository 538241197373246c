//! Outgoing connections: one lazily dialled, authenticated control connection per peer.
//!
//! The first call to a peer dials it (bounded by the connect timeout and the call's deadline);
//! concurrent first calls share one dial. When the connection breaks, its task clears the
//! slot, every call in flight on it fails with `ConnectionLost`, and the next call dials
//! again. There is no cap on outstanding requests: such a cap is exactly the exhaustible pool
//! that deadlocks nested calls.

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::AbortHandle;

use crate::auth::{self, ConnKind, Secret};
use crate::error::RpcError;
use crate::mux::MuxClient;
use crate::transport::Transport;
use crate::wire::WorkerInfo;

pub(crate) type Client = MuxClient;

/// Everything needed to dial a peer.
pub(crate) struct DialCtx<'a> {
    pub transport: &'a Transport,
    pub secret: &'a Secret,
    pub my_rank: u32,
    pub connect_timeout: Duration,
    pub handshake_timeout: Duration,
    pub max_frame_bytes: usize,
}

struct Live {
    gen: u64,
    client: Client,
    dispatch: AbortHandle,
}

/// One peer's outgoing control connection.
pub(crate) struct Peer {
    pub info: WorkerInfo,
    pub addr: String,
    slot: Mutex<Option<Live>>,
    dial: tokio::sync::Mutex<u64>,
}

impl Peer {
    pub(crate) fn new(info: WorkerInfo, addr: String) -> Arc<Self> {
        Arc::new(Self {
            info,
            addr,
            slot: Mutex::new(None),
            dial: tokio::sync::Mutex::new(0),
        })
    }

    /// The live client, if connected.
    pub(crate) fn current(&self) -> Option<(u64, Client)> {
        let slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().map(|l| (l.gen, l.client.clone()))
    }

    /// The live client, dialling if there is none.
    ///
    /// # Cancel safety
    /// Cancel safe: a dial abandoned half way leaves the slot empty.
    pub(crate) async fn client(
        self: &Arc<Self>,
        d: &DialCtx<'_>,
    ) -> Result<(u64, Client), RpcError> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let mut gen = self.dial.lock().await;
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let unreachable = |source: io::Error| RpcError::Unreachable {
            worker: self.info.name.clone(),
            addr: self.addr.clone(),
            source,
        };
        let (mut conn, _) =
            tokio::time::timeout(d.connect_timeout, d.transport.connect(&self.addr))
                .await
                .map_err(|_| {
                    unreachable(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))
                })?
                .map_err(unreachable)?;
        tokio::time::timeout(
            d.handshake_timeout,
            auth::client(&mut conn, d.secret, ConnKind::Control, d.my_rank),
        )
        .await
        .map_err(|_| {
            unreachable(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake timed out",
            ))
        })?
        .map_err(unreachable)?;
        let (client, dispatch) = MuxClient::start(conn, d.max_frame_bytes);
        *gen += 1;
        let this_gen = *gen;
        let me = Arc::clone(self);
        let task = tokio::spawn(async move {
            if let Err(e) = dispatch.await {
                tracing::debug!(peer = %me.info.name, cause = %e, "connection ended");
            }
            me.invalidate(this_gen);
        });
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(Live {
            gen: this_gen,
            client: client.clone(),
            dispatch: task.abort_handle(),
        });
        Ok((this_gen, client))
    }

    /// Forgets connection `gen` (if it is still the current one).
    pub(crate) fn invalidate(&self, gen: u64) {
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        if slot.as_ref().is_some_and(|l| l.gen == gen) {
            if let Some(l) = slot.take() {
                l.dispatch.abort();
                l.client.end();
            }
        }
    }

    /// Closes the connection, failing whatever is still in flight on it.
    pub(crate) fn close(&self) {
        if let Some(l) = self.slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
            l.dispatch.abort();
            l.client.end();
        }
    }
}
