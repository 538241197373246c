//! Outgoing control connections: one lazily dialled, multiplexed connection per peer.
//!
//! The first call to a peer dials it (through the [`Dialer`], bounded by the connect and
//! handshake timeouts); concurrent first calls share one dial. When the connection breaks, its
//! task clears the slot, every call in flight on it fails at once (MUX-2), and the next call
//! dials again. There is no cap on outstanding requests: such a cap is exactly the exhaustible
//! pool that deadlocks nested calls.

use std::sync::{Arc, Mutex};
use tokio::task::AbortHandle;

use super::auth::ConnKind;
use super::dial::{DialError, Dialer};
use super::mux_client::MuxClient;

struct Live {
    gen: u64,
    client: MuxClient,
    dispatch: AbortHandle,
}

/// One peer's outgoing control connection.
pub(crate) struct Peer {
    rank: u32,
    slot: Mutex<Option<Live>>,
    dial: tokio::sync::Mutex<u64>,
}

impl Peer {
    pub(crate) fn new(rank: u32) -> Arc<Self> {
        Arc::new(Self {
            rank,
            slot: Mutex::new(None),
            dial: tokio::sync::Mutex::new(0),
        })
    }

    /// The live connection (its generation and calling end), if connected.
    pub(crate) fn current(&self) -> Option<(u64, MuxClient)> {
        let slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().map(|l| (l.gen, l.client.clone()))
    }

    /// The live connection, dialled with `dialer` if there is none.
    ///
    /// # Cancel safety
    /// Cancel safe: a dial abandoned half way leaves the slot empty.
    pub(crate) async fn client(
        self: &Arc<Self>,
        dialer: &Dialer,
        max_frame: usize,
        max_queued: usize,
    ) -> Result<(u64, MuxClient), DialError> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let mut gen = self.dial.lock().await;
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let conn = dialer.dial(self.rank, ConnKind::Control).await?;
        let (client, dispatch) = MuxClient::start(conn, max_frame, max_queued);
        *gen += 1;
        let this_gen = *gen;
        let me = Arc::clone(self);
        let peer = dialer.directory().name(self.rank).to_owned();
        let task = tokio::spawn(async move {
            if let Err(e) = dispatch.await {
                tracing::debug!(%peer, cause = %e, "connection ended");
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
