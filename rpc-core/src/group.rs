//! Who is who: this worker and the group it belongs to, by rank and by name, and the ways a
//! program names a call's target ([`ToWorker`]).

use std::sync::Arc;

use crate::error::RpcError;
use crate::net::Directory;
use crate::wire::{WorkerId, WorkerInfo};

/// A way to name a call's target: a worker name, a rank, or a [`WorkerInfo`].
pub trait ToWorker {
    /// The name or rank this refers to.
    fn worker_ref(&self) -> WorkerRef<'_>;
}

/// A worker named by name or by rank.
#[derive(Clone, Copy, Debug)]
pub enum WorkerRef<'a> {
    /// By unique name.
    Name(&'a str),
    /// By rank.
    Rank(u32),
}

impl ToWorker for str {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Name(self)
    }
}
impl ToWorker for String {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Name(self)
    }
}
impl ToWorker for u32 {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Rank(*self)
    }
}
impl ToWorker for usize {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Rank(u32::try_from(*self).unwrap_or(u32::MAX))
    }
}
impl ToWorker for WorkerId {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Rank(self.0)
    }
}
impl ToWorker for WorkerInfo {
    fn worker_ref(&self) -> WorkerRef<'_> {
        WorkerRef::Rank(self.id.0)
    }
}
impl<T: ToWorker + ?Sized> ToWorker for &T {
    fn worker_ref(&self) -> WorkerRef<'_> {
        (**self).worker_ref()
    }
}

/// This worker and its group.
pub(crate) struct Group {
    me: u32,
    directory: Arc<Directory>,
    my_addr: String,
}

impl Group {
    /// Worker `me` of the group `directory` lists.
    pub(crate) fn new(me: u32, directory: Arc<Directory>) -> Self {
        let my_addr = directory.addr(me).to_string();
        Self {
            me,
            directory,
            my_addr,
        }
    }

    /// This worker's rank.
    pub(crate) fn rank(&self) -> u32 {
        self.me
    }

    /// Number of ranks (vacant ones of a group that grows included).
    pub(crate) fn size(&self) -> usize {
        self.directory.capacity()
    }

    /// Worker `rank` (a rank of the group: one from [`Group::resolve`] or from a connection's
    /// authenticated handshake).
    pub(crate) fn worker(&self, rank: u32) -> &WorkerInfo {
        self.directory.info(rank)
    }

    /// The address this worker listens at.
    pub(crate) fn my_addr(&self) -> &str {
        &self.my_addr
    }

    /// The rank `to` names, if it names a worker of the group.
    pub(crate) fn resolve(&self, to: &impl ToWorker) -> Result<u32, RpcError> {
        let r = to.worker_ref();
        let found = match r {
            WorkerRef::Name(n) => self.directory.rank_of(n),
            WorkerRef::Rank(r) => {
                ((r as usize) < self.size() && !self.directory.is_vacant(r)).then_some(r)
            }
        };
        found.ok_or_else(|| RpcError::UnknownWorker {
            target: match r {
                WorkerRef::Name(n) => format!("named `{n}`"),
                WorkerRef::Rank(r) if (r as usize) < self.size() => {
                    format!("of rank {r} (vacant: no worker has joined it yet)")
                }
                WorkerRef::Rank(r) => format!("of rank {r}"),
            },
            world_size: self.size(),
        })
    }

    /// The name of a worker for messages: its name, or a description of the reference if it
    /// names no worker of the group.
    pub(crate) fn name_of(&self, to: &impl ToWorker) -> String {
        match self.resolve(to) {
            Ok(r) => self.worker(r).name.clone(),
            Err(_) => match to.worker_ref() {
                WorkerRef::Name(n) => n.to_owned(),
                WorkerRef::Rank(r) => format!("rank {r}"),
            },
        }
    }

    /// Every worker that has joined (whatever its standing now), by rank.
    pub(crate) fn workers(&self) -> Vec<WorkerInfo> {
        self.directory.workers()
    }
}
