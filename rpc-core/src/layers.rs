//! What layers above the RPC core attach to one worker: per-agent state (extensions),
//! shutdown hooks and call-metadata providers. Plain state; [`AgentExt`](crate::ext::AgentExt)
//! is how layers reach it.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use crate::wire::{CallMeta, WorkerId};

/// Computes a call-metadata value for each outgoing call from its destination (see
/// [`AgentExt::set_meta_provider`](crate::ext::AgentExt::set_meta_provider)); `None` removes
/// the key for that call.
pub type MetaProvider = Arc<dyn Fn(WorkerId) -> Option<Vec<u8>> + Send + Sync>;

/// Work to finish before the shutdown barrier (see
/// [`AgentExt::on_shutdown`](crate::ext::AgentExt::on_shutdown)).
pub type ShutdownHook = Box<dyn Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// What layers attached to one agent.
#[derive(Default)]
pub(crate) struct Layers {
    extensions: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
    hooks: Mutex<Vec<ShutdownHook>>,
    providers: RwLock<Vec<(&'static str, MetaProvider)>>,
}

impl Layers {
    /// The layer state of type `T`, made by `init` on first use.
    pub(crate) fn extension<T: Send + Sync + 'static>(&self, init: impl FnOnce() -> T) -> Arc<T> {
        let mut ext = self.extensions.lock().unwrap_or_else(|p| p.into_inner());
        let any = ext
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(init()))
            .clone();
        any.downcast::<T>().expect("keyed by TypeId")
    }

    /// Adds a shutdown hook.
    pub(crate) fn on_shutdown(&self, hook: ShutdownHook) {
        self.hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// Sets the provider of metadata key `key` (replacing an earlier one of the same key).
    pub(crate) fn set_provider(&self, key: &'static str, provider: MetaProvider) {
        let mut p = self.providers.write().unwrap_or_else(|e| e.into_inner());
        p.retain(|(k, _)| *k != key);
        p.push((key, provider));
    }

    /// `base` (the caller's metadata) as the providers adjust it for a call to `to`.
    pub(crate) fn outgoing_meta(&self, base: CallMeta, to: u32) -> CallMeta {
        let mut meta = base;
        let p = self.providers.read().unwrap_or_else(|e| e.into_inner());
        for (key, provider) in p.iter() {
            meta = match provider(WorkerId(to)) {
                Some(v) => meta.with(key, v),
                None => meta.without(key),
            };
        }
        meta
    }

    /// Starts every shutdown hook.
    pub(crate) fn shutdown_hooks(&self) -> Vec<futures::future::BoxFuture<'static, ()>> {
        let hooks = self.hooks.lock().unwrap_or_else(|p| p.into_inner());
        hooks.iter().map(|h| h()).collect()
    }
}
