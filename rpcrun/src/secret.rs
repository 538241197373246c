//! The group secret, handed to children as a file only this user can read.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rpc_core::{Secret, SECRET_ENV, SECRET_FILE_ENV};

use crate::{Launch, LaunchError};

/// The secret's file; a file the launcher wrote is removed (with its directory) on drop.
#[derive(Debug)]
pub(crate) struct SecretFile {
    path: PathBuf,
    owned_dir: Option<PathBuf>,
}

impl SecretFile {
    /// The secret for `launch`: its file if given, else the launcher's `RPC_SECRET_FILE`, else
    /// its `RPC_SECRET` written to a private file, else (one node) a fresh random one.
    pub(crate) fn resolve(launch: &Launch) -> Result<Self, LaunchError> {
        let given = launch
            .secret_file
            .clone()
            .or_else(|| std::env::var_os(SECRET_FILE_ENV).map(PathBuf::from));
        if let Some(path) = given {
            let err = |source| LaunchError::Secret {
                path: path.display().to_string(),
                source,
            };
            let bytes = std::fs::read(&path).map_err(err)?;
            if bytes.strip_suffix(b"\n").unwrap_or(&bytes).is_empty() {
                return Err(err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "the file is empty",
                )));
            }
            return Ok(Self {
                path,
                owned_dir: None,
            });
        }
        let secret = match std::env::var(SECRET_ENV) {
            Ok(s) if !s.is_empty() => s,
            _ if launch.nnodes > 1 => {
                return Err(LaunchError::Invalid(format!(
                    "--nnodes {} needs a secret every node shares: \
                     --secret-file PATH (or {SECRET_FILE_ENV})",
                    launch.nnodes
                )))
            }
            _ => Secret::generate()
                .as_str()
                .expect("generated secrets are text")
                .to_owned(),
        };
        Self::write_private(&secret)
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn write_private(secret: &str) -> Result<Self, LaunchError> {
        let mut nonce = [0u8; 8];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut nonce))
            .map_err(|source| LaunchError::System {
                what: "reading /dev/urandom",
                source,
            })?;
        let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        let dir = std::env::temp_dir().join(format!("rpcrun-{}-{hex}", std::process::id()));
        let path = dir.join("secret");
        let err = |source| LaunchError::Secret {
            path: path.display().to_string(),
            source,
        };
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(err)?;
        let file = Self {
            path: path.clone(),
            owned_dir: Some(dir),
        };
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(err)?;
        f.write_all(secret.as_bytes()).map_err(err)?;
        Ok(file)
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        if let Some(d) = &self.owned_dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_written_secret_is_private_and_removed_at_the_end() {
        let f = SecretFile::write_private("s3cret-of-some-length").unwrap();
        let p = f.path().to_owned();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "s3cret-of-some-length"
        );
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dir_mode = std::fs::metadata(p.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode, 0o700);
        drop(f);
        assert!(!p.exists());
        assert!(!p.parent().unwrap().exists());
    }
}
