//! Globally unique ids: an RRef is named by the worker that created it and a counter there;
//! so is each fork (one handle's claim on the value).

use serde::{Deserialize, Serialize};
use std::fmt;

/// Names one remote value, globally.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RRefId {
    /// Rank of the worker that created the id.
    pub created_on: u32,
    /// Counter on that worker (the top 16 bits are its incarnation: a restarted process never
    /// reuses its predecessor's ids).
    pub local: u64,
}

/// Names one fork (one worker's handle) of a remote value, globally.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ForkId {
    /// Rank of the worker that created the id.
    pub created_on: u32,
    /// Counter on that worker (the top 16 bits are its incarnation: a restarted process never
    /// reuses its predecessor's ids).
    pub local: u64,
}

impl fmt::Display for RRefId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rref {}:{}", self.created_on, self.local)
    }
}

impl fmt::Display for ForkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fork {}:{}", self.created_on, self.local)
    }
}
