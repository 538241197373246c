//! A rendezvous listener handed over by whoever chose its port (RDV-8).
//!
//! A launcher that picks a free port for the rendezvous and lets the port go before rank 0
//! binds it leaves a window in which any other process on the host may take it (an outgoing
//! connection's ephemeral port is enough): rank 0 then fails with "Address already in use" and
//! a restart is spent on nothing. So the launcher keeps the socket it bound and hands it to the
//! process that serves the rendezvous: to a child as an inherited descriptor named in
//! [`RENDEZVOUS_FD_ENV`], to its own process through
//! [`Config::with_rendezvous_listener`](crate::Config::with_rendezvous_listener).

use std::net::TcpListener;
use std::sync::{Mutex, OnceLock};

use crate::error::InitError;

/// The variable in which a launcher names the descriptor of a listening TCP socket, bound to
/// the rendezvous's port and inherited by the process that serves the rendezvous: that process
/// serves on it instead of binding the port again (RDV-8). `rpcrun` sets it for rank 0 when it
/// chose the port itself.
pub const RENDEZVOUS_FD_ENV: &str = "RPC_RENDEZVOUS_FD";

/// The socket this process inherited, taken once (closed on exec from then on); later agents
/// of the process serve on copies of it.
static HANDED: OnceLock<Mutex<Option<TcpListener>>> = OnceLock::new();

/// A copy of the listener that `v`, the value of [`RENDEZVOUS_FD_ENV`], names; an error
/// naming the variable when it names no listening TCP socket this process inherited.
pub(crate) fn inherited(v: &str) -> Result<TcpListener, InitError> {
    let slot = HANDED.get_or_init(|| Mutex::new(v.trim().parse().ok().and_then(take)));
    let held = slot.lock().unwrap_or_else(|p| p.into_inner());
    match held.as_ref() {
        Some(l) => l.try_clone().map_err(|e| {
            InitError::Config(format!(
                "{RENDEZVOUS_FD_ENV}={v}: cannot copy the socket: {e}"
            ))
        }),
        None => Err(InitError::Config(format!(
            "{RENDEZVOUS_FD_ENV}={v:?} names no listening TCP socket this process inherited"
        ))),
    }
}

/// Takes `fd` if it is a socket: closed on exec from now on (a program this process starts
/// does not hold the port).
fn take(fd: i32) -> Option<TcpListener> {
    use std::os::fd::FromRawFd;
    // SAFETY: fstat and fcntl only read and set flags of a descriptor number; a closed or
    // foreign number fails the check and is left alone.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if fd < 3 || libc::fstat(fd, &mut st) != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
            return None;
        }
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        // SAFETY: the process owns the descriptor its launcher handed it, and only this
        // OnceLock takes it.
        let l = TcpListener::from_raw_fd(fd);
        // A socket that is not a bound TCP listener has no local address of a TCP kind.
        l.local_addr().ok().map(|_| l)
    }
}

/// `listener` if it listens on `rendezvous`'s port; an error naming both otherwise (a
/// launcher that handed over one socket and named another port).
pub(crate) fn check(listener: TcpListener, rendezvous: &str) -> Result<TcpListener, InitError> {
    let local = listener
        .local_addr()
        .map_err(|e| InitError::Config(format!("the rendezvous listener handed over: {e}")))?;
    let port = rendezvous.rsplit_once(':').map(|(_, p)| p);
    if port != Some(local.port().to_string().as_str()) {
        return Err(InitError::Config(format!(
            "the rendezvous listener handed over listens on {local}, but the rendezvous is \
             {rendezvous}"
        )));
    }
    Ok(listener)
}
