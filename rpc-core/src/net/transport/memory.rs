//! The in-memory network: named listeners, `tokio::io::duplex` connections.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex};
use tokio::io::DuplexStream;
use tokio::sync::mpsc;

use super::Conn;

/// Size of each direction's in-memory pipe buffer.
const PIPE_BYTES: usize = 1 << 20;
/// Connections that may wait to be accepted on one listener.
const BACKLOG: usize = 1024;

/// An in-process network. Clone it to give every worker of a group the same network.
///
/// ```
/// let net = rpc_core::MemoryNetwork::new();
/// let transport = rpc_core::Transport::Memory(net.clone());
/// # let _ = transport;
/// ```
#[derive(Clone, Default)]
pub struct MemoryNetwork {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    listeners: HashMap<String, mpsc::Sender<DuplexStream>>,
    next_port: u64,
}

impl std::fmt::Debug for MemoryNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.inner.lock().map(|i| i.listeners.len()).unwrap_or(0);
        f.debug_struct("MemoryNetwork")
            .field("listeners", &n)
            .finish()
    }
}

impl MemoryNetwork {
    /// A new, empty network.
    pub fn new() -> Self {
        Self::default()
    }

    /// Binds `addr`; an address ending in `:0` (or empty) gets a fresh unique name.
    pub(crate) fn bind(&self, addr: &str) -> io::Result<MemListener> {
        let mut inner = self
            .inner
            .lock()
            .map_err(|_| io::Error::other("network poisoned"))?;
        let name = if addr.is_empty() || addr.ends_with(":0") {
            inner.next_port += 1;
            let host = addr.rsplit_once(':').map_or("mem", |(h, _)| h);
            format!("{host}:{}", inner.next_port + 10_000)
        } else {
            addr.to_owned()
        };
        if let Some(tx) = inner.listeners.get(&name) {
            if !tx.is_closed() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("memory address {name} in use"),
                ));
            }
        }
        let (tx, rx) = mpsc::channel(BACKLOG);
        inner.listeners.insert(name.clone(), tx);
        Ok(MemListener { addr: name, rx })
    }

    pub(crate) async fn connect(&self, addr: &str) -> io::Result<Conn> {
        let tx = {
            let inner = self
                .inner
                .lock()
                .map_err(|_| io::Error::other("network poisoned"))?;
            inner.listeners.get(addr).cloned()
        };
        let refused = || {
            io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!("nothing listens on memory address {addr}"),
            )
        };
        let tx = tx.ok_or_else(refused)?;
        let (client, server) = tokio::io::duplex(PIPE_BYTES);
        tx.send(server).await.map_err(|_| refused())?;
        Ok(Box::new(client))
    }
}

/// A listener on the in-memory network; unbinds when dropped.
pub(crate) struct MemListener {
    addr: String,
    rx: mpsc::Receiver<DuplexStream>,
}

impl MemListener {
    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    pub(crate) async fn accept(&mut self) -> io::Result<Conn> {
        match self.rx.recv().await {
            Some(s) => Ok(Box::new(s)),
            None => Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "network dropped",
            )),
        }
    }
}
