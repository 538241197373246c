//! The group's shared secret: where it comes from (the environment, a file), and the keyed
//! MAC the handshake (`auth.rs`) proves it with; the OS's random source.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::sync::Arc;

use crate::error::InitError;

/// Env var holding the group secret.
pub const SECRET_ENV: &str = "RPC_SECRET";
/// Env var naming a file that holds the group secret.
pub const SECRET_FILE_ENV: &str = "RPC_SECRET_FILE";

/// The group's shared secret. Its `Debug` output is redacted.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(<{} bytes redacted>)", self.0.len())
    }
}

impl Secret {
    /// A secret from raw bytes.
    pub fn new(bytes: impl AsRef<[u8]>) -> Self {
        Self(Arc::from(bytes.as_ref()))
    }

    /// 32 random bytes, hex-encoded (so it can be passed through an env var).
    ///
    /// ```
    /// let s = rpc_core::Secret::generate();
    /// assert_eq!(s.as_str().unwrap().len(), 64);
    /// ```
    pub fn generate() -> Self {
        let mut raw = [0u8; 32];
        fill_random(&mut raw);
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        Self::new(hex)
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The secret as text, if it is UTF-8 (to hand to child processes via [`SECRET_ENV`]).
    pub fn as_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// Reads [`SECRET_ENV`], else the file named by [`SECRET_FILE_ENV`] (trailing newline
    /// trimmed); `Ok(None)` if neither is set.
    pub fn from_env() -> Result<Option<Self>, InitError> {
        Self::from_env_with(&|k| std::env::var(k).ok())
    }

    pub(crate) fn from_env_with(
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, InitError> {
        if let Some(s) = env(SECRET_ENV) {
            if !s.is_empty() {
                return Ok(Some(Self::new(s)));
            }
        }
        if let Some(path) = env(SECRET_FILE_ENV) {
            return Self::from_file(std::path::Path::new(&path)).map(Some);
        }
        Ok(None)
    }

    /// The secret in the file at `path` (trailing newline trimmed), as [`SECRET_FILE_ENV`]
    /// names it for workers.
    pub fn from_file(path: &std::path::Path) -> Result<Self, InitError> {
        let shown = path.display().to_string();
        let data = std::fs::read(path).map_err(|source| InitError::SecretFile {
            path: shown.clone(),
            source,
        })?;
        let trimmed = data.strip_suffix(b"\n").unwrap_or(&data);
        if trimmed.is_empty() {
            return Err(InitError::Config(format!("secret file {shown} is empty")));
        }
        Ok(Self::new(trimmed))
    }

    /// The secret's bytes (to derive keys from).
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }

    pub(crate) fn mac(&self, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("hmac takes any key length");
        for p in parts {
            m.update(p);
        }
        m
    }
}

pub(crate) fn fill_random(buf: &mut [u8]) {
    getrandom::getrandom(buf).expect("the OS random source is available");
}
