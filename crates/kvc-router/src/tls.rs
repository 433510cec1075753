//! TLS of the listeners, with rustls (the `ring` provider; no system library): the HTTP front
//! (`[tls.http]`) and the gRPC control API (`[tls.grpc]`), each from a PEM certificate chain
//! and a PEM private key; the gRPC listener can also require client certificates signed by a
//! given CA (`client-ca`: mutual TLS). A listener without a `[tls.*]` table is plain TCP.
//!
//! Files are read once at startup; one that cannot be read or parsed stops the start with an
//! error naming it. A TLS handshake must finish within [`HANDSHAKE_TIMEOUT`]. On the HTTP front
//! each handshake runs in its connection's own task, holding one of the front's connection
//! places (`max-connections`), so a slow client holds up no one else. The HTTP front speaks
//! HTTP/1.1 over TLS (ALPN `http/1.1`); the gRPC listener HTTP/2 (ALPN `h2`).

use crate::config::PerListener;
use crate::error::ConfigError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The longest a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS of the listeners: the `[tls]` table. `[tls.http]`: the HTTP front's certificate and
/// key (`client-ca` is not supported there); `[tls.grpc]`: the gRPC listener's, and optionally
/// the CA its clients' certificates must be signed by.
pub type TlsConfig = PerListener<ListenerTls>;

impl TlsConfig {
    /// Checks the tables: `client-ca` only in `[tls.grpc]`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.http.as_ref().is_some_and(|t| t.client_ca.is_some()) {
            return Err(ConfigError::Invalid(
                "tls.http.client-ca is not supported (client certificates are checked on the gRPC listener only)"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// One listener's TLS files (PEM). Relative paths are from the working directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ListenerTls {
    /// The certificate chain, the listener's own certificate first.
    #[cfg_attr(feature = "schema", schemars(example = &"/etc/kvc/tls/router.pem"))]
    pub cert: PathBuf,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    #[cfg_attr(feature = "schema", schemars(example = &"/etc/kvc/tls/router.key"))]
    pub key: PathBuf,
    /// CA certificates a client's certificate must chain to; a client without one is refused
    /// during the handshake (mutual TLS). gRPC only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(example = &"/etc/kvc/tls/clients.pem"))]
    pub client_ca: Option<PathBuf>,
}

fn read(path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })
}

fn invalid(table: &str, key: &str, path: &Path, why: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid(format!("{table}.{key} {}: {why}", path.display()))
}

/// The certificates of a PEM file (at least one).
fn certificates(
    table: &str,
    key: &str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(table, key, path, e))?;
    if certs.is_empty() {
        return Err(invalid(table, key, path, "no PEM certificate in it"));
    }
    Ok(certs)
}

fn private_key(table: &str, path: &Path) -> Result<PrivateKeyDer<'static>, ConfigError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| invalid(table, "key", path, e))
}

/// The rustls provider every listener uses.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A rustls client configuration trusting only the certificates of the PEM file `ca` (named
/// `table.key` in errors), for calls the router makes to a TLS server (ALPN `http/1.1`).
pub(crate) fn client_config(
    table: &str,
    key: &str,
    ca: &Path,
) -> Result<Arc<rustls::ClientConfig>, ConfigError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(table, key, ca)? {
        roots.add(cert).map_err(|e| invalid(table, key, ca, e))?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError::Invalid(format!("{table}: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The HTTP front's rustls configuration from `tls` (ALPN `http/1.1`).
pub fn http_server_config(tls: &ListenerTls) -> Result<Arc<rustls::ServerConfig>, ConfigError> {
    const TABLE: &str = "tls.http";
    let certs = certificates(TABLE, "cert", &tls.cert)?;
    let key = private_key(TABLE, &tls.key)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError::Invalid(format!("{TABLE}: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| invalid(TABLE, "key", &tls.key, e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The gRPC listener's tonic TLS configuration from `tls`. The files are parsed here too
/// (tonic would only find a bad one when the server starts), so errors name the file.
pub fn grpc_server_config(
    tls: &ListenerTls,
) -> Result<tonic::transport::ServerTlsConfig, ConfigError> {
    const TABLE: &str = "tls.grpc";
    let certs = certificates(TABLE, "cert", &tls.cert)?;
    let key = private_key(TABLE, &tls.key)?;
    // The same check tonic's acceptor makes, with the file named when it fails.
    rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError::Invalid(format!("{TABLE}: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| invalid(TABLE, "key", &tls.key, e))?;
    let identity = tonic::transport::Identity::from_pem(read(&tls.cert)?, read(&tls.key)?);
    let mut config = tonic::transport::ServerTlsConfig::new()
        .identity(identity)
        .timeout(HANDSHAKE_TIMEOUT);
    if let Some(ca) = &tls.client_ca {
        let roots = certificates(TABLE, "client-ca", ca)?;
        let mut store = rustls::RootCertStore::empty();
        for cert in roots {
            store
                .add(cert)
                .map_err(|e| invalid(TABLE, "client-ca", ca, e))?;
        }
        config = config.client_ca_root(tonic::transport::Certificate::from_pem(read(ca)?));
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ca_is_a_grpc_key() {
        let t = ListenerTls {
            cert: "/c".into(),
            key: "/k".into(),
            client_ca: Some("/ca".into()),
        };
        let http = TlsConfig {
            http: Some(t.clone()),
            grpc: None,
        };
        assert!(
            matches!(http.validate(), Err(ConfigError::Invalid(ref m)) if m.contains("tls.http.client-ca"))
        );
        let grpc = TlsConfig {
            http: None,
            grpc: Some(t),
        };
        assert!(grpc.validate().is_ok());
    }

    #[test]
    fn unreadable_and_garbage_files_are_named() {
        let missing = ListenerTls {
            cert: "/nonexistent/cert.pem".into(),
            key: "/nonexistent/key.pem".into(),
            client_ca: None,
        };
        assert!(matches!(
            http_server_config(&missing),
            Err(ConfigError::Read { ref path, .. }) if path == Path::new("/nonexistent/cert.pem")
        ));
        let dir = std::env::temp_dir().join(format!("kvc-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let garbage = dir.join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").unwrap();
        let bad = ListenerTls {
            cert: garbage.clone(),
            key: garbage.clone(),
            client_ca: None,
        };
        for err in [
            http_server_config(&bad).unwrap_err().to_string(),
            grpc_server_config(&bad).unwrap_err().to_string(),
        ] {
            assert!(err.contains("garbage.pem"), "{err}");
            assert!(err.contains(".cert"), "{err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
