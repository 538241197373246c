//! [`RRef<T>`]: a handle on a value owned by one worker, usable from any worker.

use rpc_core::ext::{AgentExt, KeptValue, MessageContext, MessageKind, Payload};
use rpc_core::{Agent, RemoteFn, RpcError, ToWorker, WorkerId};
use serde::de::{self, DeserializeOwned};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::context::{ctx, Settled};
use crate::error::RRefError;
use crate::handle::{HState, Handle};
use crate::id::{ForkId, RRefId};
use crate::owner::Value;
use crate::protocol::{self, AddFork, ChildAccepted, Fetch, KEEP_SINK};

/// A reference to a value of type `T` owned by one worker of the group.
///
/// Cloning is local (clones share one fork). Sending an `RRef` inside the arguments or result
/// of any call (nested in structs and collections too) shares it with the receiver: the
/// protocol registers the new fork with the owner, and the owner keeps the value exactly as
/// long as a handle exists anywhere. Dropping the last handle on a worker tells the owner, from
/// a background task (no blocking in `Drop`).
pub struct RRef<T> {
    h: Arc<Handle>,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for RRef<T> {
    fn clone(&self) -> Self {
        Self {
            h: self.h.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> fmt::Debug for RRef<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RRef")
            .field("id", &self.h.id)
            .field("owner", &self.h.owner)
            .field("fork", &self.h.fork)
            .field("type", &std::any::type_name::<T>())
            .finish()
    }
}

#[derive(Serialize, Deserialize)]
struct WireRRef {
    id: RRefId,
    owner: u32,
    /// The owner's incarnation that holds the value.
    owner_incarnation: u64,
    child: ForkId,
    parent: u32,
    /// Sent to the owner in a request whose answer releases the parent's hold: the owner
    /// registers the child while decoding, before it answers, and sends no acceptance.
    released_on_answer: bool,
}

impl<T> Serialize for RRef<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let msg =
            MessageContext::current().ok_or_else(|| S::Error::custom(RRefError::OutsideRpc))?;
        let c = &self.h.ctx;
        if msg.agent().rank() != c.me {
            return Err(S::Error::custom(
                "an RRef was sent through another worker's agent",
            ));
        }
        // G2: hold our fork until the owner has accepted the child; or, if the request
        // carrying it is refused unread, not at all (nobody will ever register the child).
        let child = c.new_fork_id();
        c.hold_child(child, self.h.clone(), msg.peer().0, self.h.owner);
        let lender = c.clone();
        let to_owner = msg.kind() == MessageKind::Request && msg.peer().0 == self.h.owner;
        let released_on_answer = if to_owner {
            msg.on_answered(move || lender.release_child(child))
        } else {
            msg.on_undelivered(move || lender.release_child(child));
            false
        };
        WireRRef {
            id: self.h.id,
            owner: self.h.owner,
            owner_incarnation: self.h.owner_incarnation,
            child,
            parent: c.me,
            released_on_answer,
        }
        .serialize(s)
    }
}

impl<'de, T> Deserialize<'de> for RRef<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = WireRRef::deserialize(d)?;
        let msg =
            MessageContext::current().ok_or_else(|| de::Error::custom(RRefError::OutsideRpc))?;
        let agent = msg.agent().clone();
        let c = ctx(&agent);
        if w.owner == c.me {
            c.owner_add(w.id, w.child, 1, c.me);
            let owner = (w.owner, w.owner_incarnation);
            let h = Handle::new(&c, w.id, w.child, owner, HState::Confirmed);
            if w.released_on_answer {
                return Ok(Self::from_handle(h));
            }
            let parent = w.parent;
            let child = w.child;
            let a = agent.clone();
            c.background(&agent, async move {
                if let Err(e) = a.rpc_async(parent, ChildAccepted, (child,)).await {
                    tracing::debug!(
                        %child, cause = %rpc_core::error_chain(&e), "child acceptance not delivered"
                    );
                }
            });
            return Ok(Self::from_handle(h));
        }
        let owner = (w.owner, w.owner_incarnation);
        let h = Handle::new(&c, w.id, w.child, owner, HState::Unconfirmed);
        let held = h.clone();
        if let Some(now) = h.owner_replaced(&agent) {
            // Nothing to register with: the value went with the incarnation that owned it.
            h.settle(Err(RpcError::PeerFailed {
                worker: agent.name_of(w.owner),
                fn_name: "rref::AddFork".into(),
                cause: format!(
                    "incarnation {} was replaced by incarnation {now}",
                    w.owner_incarnation
                ),
            }));
            return Ok(Self::from_handle(h));
        }
        let a = agent.clone();
        // CTX-1: the task holds the handle, so its delete follows the registration.
        c.background(&agent, async move {
            let r = a
                .rpc_async(w.owner, AddFork, (w.id, w.child, w.parent))
                .await;
            held.settle(r);
        });
        Ok(Self::from_handle(h))
    }
}

/// Runs `f` on `to` and returns at once a reference to its result, which stays on `to`.
///
/// It does not wait for the owner: when the connection to `to` is up, the constructor's
/// request is queued before this returns (so whatever this worker sends `to` next, a fetch of
/// the reference or a call that takes it, arrives after it), and only the wait for the
/// owner's answer runs in the background. The constructor's failure is reported by the next
/// use of the reference.
///
/// ```
/// # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use rpc_core::{remote, testing, BoxError, CallContext, Registry, Secret, Transport};
///
/// #[remote]
/// async fn make(_ctx: CallContext, n: u32) -> Result<Vec<u32>, BoxError> {
///     Ok((0..n).collect())
/// }
///
/// let reg = |_| rref::install(Registry::builder().register(make).unwrap()).unwrap().build();
/// let a = testing::start_group(2, Transport::Tcp, Secret::generate(), reg, |_, c| c).await?;
/// let r = rref::remote(&a[0], 1u32, make, (4,))?; // returns at once
/// assert_eq!(r.to_here().await?, vec![0, 1, 2, 3]);
/// drop(r);
/// futures::future::join_all(a.iter().map(|w| w.shutdown())).await;
/// # Ok(()) }
/// ```
pub fn remote<F: RemoteFn>(
    agent: &Agent,
    to: impl ToWorker,
    f: F,
    args: F::Args,
) -> Result<RRef<F::Output>, RRefError> {
    let owner = agent
        .get_worker_info(&to)
        .map_err(|source| RRefError::Rpc {
            id: "a new rref".into(),
            source: Box::new(source),
        })?
        .id
        .0;
    let c = ctx(agent);
    let id = c.new_rref_id();
    let fork = c.new_fork_id();
    let incarnation = agent.incarnation_of(owner).unwrap_or(0);
    let h = Handle::with_creator(
        &c,
        id,
        fork,
        (owner, incarnation),
        HState::Unconfirmed,
        true,
    );
    let held = h.clone();
    let token = protocol::token(id, fork);
    if c.jittered() {
        // Tests of reorderings: the creation is delayed like any other protocol message.
        let a = agent.clone();
        c.background(agent, async move {
            let r = a.rpc_keep(owner, f, args, KEEP_SINK, token).await;
            held.settle(r);
        });
    } else {
        // Queued now, ahead of anything this worker sends the owner next (a fetch of the new
        // reference, a call that takes it), so the owner finds the value made instead of
        // waiting for it; only the wait for the owner's answer runs as a task.
        let call = agent.rpc_keep(owner, f, args, KEEP_SINK, token);
        c.background(agent, async move {
            let r = call.await;
            held.settle(r);
        });
    }
    Ok(RRef::from_handle(h))
}

fn default_deadline(agent: &Agent) -> Instant {
    Instant::now() + agent.wait_bound()
}

/// Builds `(head, a, b, ...)` from `(a, b, ...)`: lets method proxies put the RRef first.
pub trait PrependArg<H> {
    /// The tuple with `H` in front.
    type Out;
    /// Puts `head` in front.
    fn prepend(self, head: H) -> Self::Out;
}

macro_rules! prepend_impls {
    ($( ( $($n:ident),* ) )*) => {$(
        impl<H, $($n),*> PrependArg<H> for ($($n,)*) {
            type Out = (H, $($n,)*);
            #[allow(non_snake_case, clippy::unused_unit)]
            fn prepend(self, head: H) -> Self::Out {
                let ($($n,)*) = self;
                (head, $($n,)*)
            }
        }
    )*};
}
prepend_impls! { () (A) (A, B) (A, B, C) (A, B, C, D) (A, B, C, D, E) (A, B, C, D, E, G) }

/// Exclusive access to an owned value (see [`RRef::local_value`]).
pub struct LocalValue<T> {
    v: Value,
    _t: PhantomData<fn() -> T>,
}

impl<T: 'static> LocalValue<T> {
    /// Locks the value for exclusive access.
    ///
    /// # Cancel safety
    /// Cancel safe (tokio's mutex).
    pub async fn lock(&self) -> tokio::sync::MappedMutexGuard<'_, T> {
        tokio::sync::MutexGuard::map(self.v.lock().await, |k| {
            k.downcast_mut::<T>()
                .expect("type checked when the LocalValue was made")
        })
    }
}

impl<T> RRef<T> {
    fn from_handle(h: Arc<Handle>) -> Self {
        Self { h, _t: PhantomData }
    }
}

impl<T: 'static> RRef<T> {
    /// A new value owned by this worker.
    pub fn new(agent: &Agent, value: T) -> Self
    where
        T: Serialize + Send + 'static,
    {
        let c = ctx(agent);
        let id = c.new_rref_id();
        let fork = c.new_fork_id();
        c.owner_add(id, fork, 1, c.me);
        let extra = c
            .owner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .set(id, Ok(KeptValue::new(value)));
        drop(extra);
        let me = (c.me, agent.incarnation());
        Self::from_handle(Handle::new(&c, id, fork, me, HState::Confirmed))
    }

    /// The reference's global id.
    pub fn id(&self) -> RRefId {
        self.h.id
    }

    /// The owner's id.
    pub fn owner(&self) -> WorkerId {
        WorkerId(self.h.owner)
    }

    /// The owner's name.
    pub fn owner_name(&self) -> String {
        match self.h.ctx.agent.upgrade() {
            Some(a) => a.name_of(self.h.owner),
            None => format!("rank {}", self.h.owner),
        }
    }

    /// Whether this worker owns the value.
    pub fn is_owner(&self) -> bool {
        self.h.owner == self.h.ctx.me
    }

    /// Whether the owner has confirmed this handle (always true on the owner).
    pub fn confirmed_by_owner(&self) -> bool {
        self.is_owner() || matches!(self.h.state(), HState::Confirmed)
    }

    fn agent(&self) -> Result<Agent, RRefError> {
        self.h.ctx.agent.upgrade().ok_or(RRefError::AgentGone)
    }

    fn check_created(&self) -> Result<(), RRefError> {
        if let Some(agent) = self.h.ctx.agent.upgrade() {
            if let Some(now) = self.h.owner_replaced(&agent) {
                return Err(RRefError::OwnerReplaced {
                    id: self.h.id.to_string(),
                    owner: self.owner_name(),
                    incarnation: self.h.owner_incarnation,
                    now,
                });
            }
        }
        match self.h.state() {
            HState::Failed(message) | HState::Lost(message) => Err(RRefError::CreationFailed {
                id: self.h.id.to_string(),
                owner: self.owner_name(),
                message,
            }),
            _ => Ok(()),
        }
    }

    /// A copy of the value, fetched from the owner (within the group's default timeout).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing changes on either side.
    pub async fn to_here(&self) -> Result<T, RRefError>
    where
        T: Clone + DeserializeOwned + Send + 'static,
    {
        let agent = self.agent()?;
        let timeout = agent.rpc_timeout();
        self.to_here_timeout(timeout).await
    }

    /// [`RRef::to_here`] with an explicit timeout (`Duration::ZERO`: none).
    pub async fn to_here_timeout(&self, timeout: Duration) -> Result<T, RRefError>
    where
        T: Clone + DeserializeOwned + Send + 'static,
    {
        self.check_created()?;
        let agent = self.agent()?;
        if self.is_owner() {
            let v = self.local_value_within(&agent, timeout).await?;
            let guard = v.lock().await;
            return Ok(guard.clone());
        }
        let fetched = agent
            .rpc_async_timeout(self.h.owner, Fetch, (self.h.id,), timeout)
            .await;
        self.fetched(agent, fetched)
    }

    /// Blocking [`RRef::to_here`], for code that is not async (PyTorch's `to_here` blocks).
    /// From a plain thread the fetch takes the thread's own connection to the owner (see
    /// [`rpc_core::Config::sync_connections`]); on the owner it is a local call.
    pub fn to_here_blocking(&self) -> Result<T, RRefError>
    where
        T: Clone + DeserializeOwned + Send + 'static,
    {
        let agent = self.agent()?;
        let timeout = agent.rpc_timeout();
        self.to_here_blocking_timeout(timeout)
    }

    /// [`RRef::to_here_blocking`] with an explicit timeout (`Duration::ZERO`: none).
    pub fn to_here_blocking_timeout(&self, timeout: Duration) -> Result<T, RRefError>
    where
        T: Clone + DeserializeOwned + Send + 'static,
    {
        self.check_created()?;
        let agent = self.agent()?;
        let fetched = agent.rpc_sync_timeout(self.h.owner, Fetch, (self.h.id,), timeout);
        self.fetched(agent, fetched)
    }

    /// The value from the owner's reply to a fetch.
    fn fetched(
        &self,
        agent: Agent,
        fetched: Result<Result<Payload, String>, RpcError>,
    ) -> Result<T, RRefError>
    where
        T: DeserializeOwned,
    {
        let id = self.h.id.to_string();
        let fetched = fetched.map_err(|source| RRefError::Rpc {
            id: id.clone(),
            source: Box::new(source),
        })?;
        let payload = fetched.map_err(|message| RRefError::CreationFailed {
            id: id.clone(),
            owner: self.owner_name(),
            message,
        })?;
        if self.h.creator && matches!(self.h.state(), HState::Unconfirmed) {
            // The owner registers the creator's fork together with the value it just served.
            self.h.settle(Ok(()));
        }
        let msg = MessageContext::new(agent, self.owner(), MessageKind::Reply);
        payload
            .decode::<T>(Some(msg))
            .map_err(|source| RRefError::Decode { id, source })
    }

    /// The value itself; on the owner only (elsewhere a [`RRefError::NotOwner`] error). Waits
    /// (within the default timeout) if the constructor is still running.
    pub async fn local_value(&self) -> Result<LocalValue<T>, RRefError> {
        let agent = self.agent()?;
        let timeout = agent.rpc_timeout();
        self.local_value_within(&agent, timeout).await
    }

    async fn local_value_within(
        &self,
        agent: &Agent,
        timeout: Duration,
    ) -> Result<LocalValue<T>, RRefError> {
        let id = self.h.id.to_string();
        if !self.is_owner() {
            return Err(RRefError::NotOwner {
                id,
                owner: self.owner_name(),
                worker: agent.name().to_owned(),
            });
        }
        self.check_created()?;
        let deadline = if timeout.is_zero() {
            default_deadline(agent).max(Instant::now() + Duration::from_secs(365 * 24 * 3600))
        } else {
            Instant::now() + timeout
        };
        let v = self
            .h
            .ctx
            .settled(self.h.id, deadline)
            .await
            .map_err(|e| match e {
                Settled::Failed(message) => RRefError::CreationFailed {
                    id: id.clone(),
                    owner: agent.name().to_owned(),
                    message,
                },
                Settled::Timeout => RRefError::Timeout {
                    id: id.clone(),
                    owner: agent.name().to_owned(),
                    timeout,
                },
            })?;
        {
            let g = v.lock().await;
            if g.downcast_ref::<T>().is_none() {
                return Err(RRefError::TypeMismatch {
                    id,
                    expected: std::any::type_name::<T>(),
                    actual: g.type_name(),
                });
            }
        }
        Ok(LocalValue { v, _t: PhantomData })
    }

    /// Calls `f` on the owner with this reference prepended to `args` (a method proxy): `f`
    /// takes the `RRef<T>` first and reaches the value with [`RRef::local_value`].
    pub fn rpc_async<F, A>(
        &self,
        f: F,
        args: A,
    ) -> impl Future<Output = Result<F::Output, RpcError>> + Send + 'static
    where
        F: RemoteFn,
        A: PrependArg<RRef<T>, Out = F::Args>,
    {
        let agent = self.agent();
        let owner = self.h.owner;
        let args = args.prepend(self.clone());
        async move {
            let agent = agent.map_err(|_| RpcError::Shutdown {
                worker: "(dropped agent)".into(),
                fn_name: F::NAME.into(),
            })?;
            agent.rpc_async(owner, f, args).await
        }
    }

    /// Blocking [`RRef::rpc_async`].
    pub fn rpc_sync<F, A>(&self, f: F, args: A) -> Result<F::Output, RRefError>
    where
        F: RemoteFn,
        A: PrependArg<RRef<T>, Out = F::Args>,
    {
        let agent = self.agent()?;
        agent
            .rpc_sync(self.h.owner, f, args.prepend(self.clone()))
            .map_err(|source| RRefError::Rpc {
                id: self.h.id.to_string(),
                source: Box::new(source),
            })
    }

    /// Runs `f` on the owner with this reference prepended to `args`, keeping the result there:
    /// returns at once with a reference to it.
    pub fn remote<F, A>(&self, f: F, args: A) -> Result<RRef<F::Output>, RRefError>
    where
        F: RemoteFn,
        A: PrependArg<RRef<T>, Out = F::Args>,
    {
        let agent = self.agent()?;
        remote(&agent, self.h.owner, f, args.prepend(self.clone()))
    }
}
