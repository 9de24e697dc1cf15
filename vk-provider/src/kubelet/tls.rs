//! The kubelet API's TLS: the serving certificate from the bridge config, and client
//! certificates required and verified against the configured CA, so only the API server
//! (its `--kubelet-client-certificate`) gets past the handshake.

use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ServerConfig, WebPkiClientVerifier};

use super::ServeError;

/// The server side of the kubelet API's TLS, from PEM files.
pub fn server_config(cert: &Path, key: &Path, client_ca: &Path) -> Result<ServerConfig, ServeError> {
    let file_error = |field: &'static str, path: &Path| {
        let path = path.to_owned();
        move |e: rustls::pki_types::pem::Error| ServeError::File { field, path, message: e.to_string() }
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(file_error("tlsCertFile", cert))?;
    if chain.is_empty() {
        return Err(ServeError::File { field: "tlsCertFile", path: cert.into(), message: "no certificate".into() });
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(file_error("tlsKeyFile", key))?;
    let mut roots = RootCertStore::empty();
    let cas = CertificateDer::pem_file_iter(client_ca)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(file_error("clientCaFile", client_ca))?;
    for ca in cas {
        roots.add(ca).map_err(|e| ServeError::File {
            field: "clientCaFile",
            path: client_ca.into(),
            message: e.to_string(),
        })?;
    }
    if roots.is_empty() {
        return Err(ServeError::File {
            field: "clientCaFile",
            path: client_ca.into(),
            message: "no certificate".into(),
        });
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| ServeError::Tls(e.to_string()))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServeError::Tls(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key_der)
        .map_err(|e| ServeError::Tls(format!("serving certificate and key: {e}")))?;
    // HTTP/1.1 only: exec and attach are upgraded HTTP/1.1 connections (SPDY), and logs
    // stream fine over chunked HTTP/1.1.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}
