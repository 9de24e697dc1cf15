//! The kubelet API's TLS: a serving certificate that can be swapped under a running listener
//! ([`ServingCert`]), and client certificates required and verified against a CA, so only
//! callers the CA vouches for get past the handshake. Which of them may do what is
//! [`super::authz`]'s decision: the CA may sign more than the API server's
//! `--kubelet-client-certificate`.
//!
//! Both come from the bridge config's files, or from the training cluster
//! ([`super::bootstrap`]): a CertificateSigningRequest, and the API server's client CA.

use std::path::Path;
use std::sync::{Arc, RwLock};

use tidepool_api::sync::ReadWrite;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, ServerConfig, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;

use super::ServeError;

/// The serving certificate every handshake gets; [`ServingCert::swap`] replaces it for the
/// handshakes that follow, without touching the listener or open connections.
#[derive(Debug)]
pub(super) struct ServingCert(RwLock<Arc<CertifiedKey>>);

impl ServingCert {
    pub(super) fn new(key: Arc<CertifiedKey>) -> Self {
        Self(RwLock::new(key))
    }

    pub(super) fn swap(&self, key: Arc<CertifiedKey>) {
        // A poisoned lock only means a writer panicked mid-assignment of an Arc: the value is
        // whole either way, so take it over.
        let mut current = self.0.write_recovered("serving certificate");
        *current = key;
    }
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read_recovered("serving certificate").clone())
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A certificate chain (leaf first) with its private key, checked to belong together.
pub(super) fn certified_key(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<CertifiedKey, rustls::Error> {
    if chain.is_empty() {
        return Err(rustls::Error::General("no certificate".into()));
    }
    CertifiedKey::from_der(chain, key, &provider())
}

/// The certificates of a PEM bundle (anything else in it is skipped, as PEM readers do).
pub(super) fn pem_certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())
}

/// A trust store of the CAs in a PEM bundle; an empty bundle is an error (it would refuse
/// every caller).
pub(super) fn roots_from_pem(pem: &[u8]) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for ca in pem_certificates(pem)? {
        roots.add(ca).map_err(|e| e.to_string())?;
    }
    if roots.is_empty() {
        return Err("no certificate".into());
    }
    Ok(roots)
}

/// The server side of the kubelet API's TLS: certificates from `cert`, callers verified
/// against `client_cas`.
pub(super) fn server_config(
    cert: Arc<dyn ResolvesServerCert>,
    client_cas: Arc<RootCertStore>,
) -> Result<ServerConfig, ServeError> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(client_cas, provider.clone())
        .build()
        .map_err(|e| ServeError::Tls(e.to_string()))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServeError::Tls(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(cert);
    // HTTP/1.1 only: exec and attach are upgraded HTTP/1.1 connections (SPDY), and logs
    // stream fine over chunked HTTP/1.1.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The serving certificate and client CAs from the PEM files of the bridge config.
pub(super) fn from_files(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Result<(CertifiedKey, RootCertStore), ServeError> {
    let file_error = |field: &'static str, path: &Path| {
        let path = path.to_owned();
        move |message: String| ServeError::File { field, path, message }
    };
    let read = |field: &'static str, path: &Path| {
        std::fs::read(path).map_err(|e| ServeError::File { field, path: path.into(), message: e.to_string() })
    };
    let chain = pem_certificates(&read("tlsCertFile", cert)?).map_err(file_error("tlsCertFile", cert))?;
    if chain.is_empty() {
        return Err(ServeError::File { field: "tlsCertFile", path: cert.into(), message: "no certificate".into() });
    }
    let key_der = PrivateKeyDer::from_pem_slice(&read("tlsKeyFile", key)?).map_err(|e| ServeError::File {
        field: "tlsKeyFile",
        path: key.into(),
        message: e.to_string(),
    })?;
    let roots = roots_from_pem(&read("clientCaFile", client_ca)?).map_err(file_error("clientCaFile", client_ca))?;
    let certified =
        certified_key(chain, key_der).map_err(|e| ServeError::Tls(format!("serving certificate and key: {e}")))?;
    Ok((certified, roots))
}

/// Certificates and handshakes for the TLS tests here and in [`super::bootstrap`].
#[cfg(test)]
pub(super) mod testing {
    use std::net::IpAddr;

    use rustls::pki_types::{PrivatePkcs8KeyDer, ServerName};
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    use super::*;

    pub(crate) const ADDRESS: &str = "10.0.0.1";

    /// A CA: its certificate and what signs with it.
    pub(crate) struct Ca {
        pub der: CertificateDer<'static>,
        pub pem: String,
        params: rcgen::CertificateParams,
        key: rcgen::KeyPair,
    }

    impl Ca {
        pub(crate) fn new(name: &str) -> Self {
            let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(rcgen::DnType::CommonName, name);
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let cert = params.self_signed(&key).unwrap();
            Self { der: cert.der().clone(), pem: cert.pem(), params, key }
        }

        /// A leaf certificate for `sans`, named `cn`, with its key.
        pub(crate) fn issue(&self, cn: &str, sans: &[&str]) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
            self.leaf(cn, None, sans)
        }

        /// A client certificate `CN=cn` in organization `organization` (at most one: rcgen
        /// keeps one value per name type), with its key.
        pub(crate) fn issue_with(
            &self,
            cn: &str,
            organization: &[&str],
        ) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
            self.leaf(cn, organization.first().copied(), &[])
        }

        fn leaf(
            &self,
            cn: &str,
            organization: Option<&str>,
            sans: &[&str],
        ) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
            let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
            let mut params =
                rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
            params.distinguished_name.push(rcgen::DnType::CommonName, cn);
            if let Some(o) = organization {
                params.distinguished_name.push(rcgen::DnType::OrganizationName, o);
            }
            let issuer = rcgen::Issuer::new(self.params.clone(), &self.key);
            let cert = params.signed_by(&key, &issuer).unwrap().der().clone();
            (cert, PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())))
        }

        pub(crate) fn roots(&self) -> Arc<RootCertStore> {
            let mut roots = RootCertStore::empty();
            roots.add(self.der.clone()).unwrap();
            Arc::new(roots)
        }
    }

    pub(crate) fn client(
        server_ca: &Ca,
        identity: Option<(CertificateDer<'static>, PrivateKeyDer<'static>)>,
    ) -> TlsConnector {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(server_ca.roots());
        let config = match identity {
            Some((cert, key)) => builder.with_client_auth_cert(vec![cert], key).unwrap(),
            None => builder.with_no_client_auth(),
        };
        TlsConnector::from(Arc::new(config))
    }

    /// One handshake: the serving certificate the client saw, or why it failed on either side.
    pub(crate) async fn handshake(
        server: &Arc<ServerConfig>,
        client: &TlsConnector,
    ) -> Result<CertificateDer<'static>, String> {
        let (server_io, client_io) = tokio::io::duplex(64 * 1024);
        let name = ServerName::from(ADDRESS.parse::<IpAddr>().unwrap());
        let (accepted, connected) =
            tokio::join!(TlsAcceptor::from(server.clone()).accept(server_io), client.connect(name, client_io));
        let connected = connected.map_err(|e| format!("client: {e}"))?;
        accepted.map_err(|e| format!("server: {e}"))?;
        Ok(connected.get_ref().1.peer_certificates().unwrap()[0].clone())
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    #[tokio::test]
    async fn a_swapped_certificate_serves_the_next_handshake_under_the_same_config() {
        let (serving_ca, client_ca) = (Ca::new("serving-ca"), Ca::new("client-ca"));
        let (first, first_key) = serving_ca.issue("system:node:tidepool", &[ADDRESS]);
        let resolver = Arc::new(ServingCert::new(Arc::new(certified_key(vec![first.clone()], first_key).unwrap())));
        let server = Arc::new(server_config(resolver.clone(), client_ca.roots()).unwrap());
        let apiserver = client(&serving_ca, Some(client_ca.issue("kube-apiserver-kubelet-client", &[])));
        assert_eq!(handshake(&server, &apiserver).await.unwrap(), first);

        let (renewed, renewed_key) = serving_ca.issue("system:node:tidepool", &[ADDRESS]);
        resolver.swap(Arc::new(certified_key(vec![renewed.clone()], renewed_key).unwrap()));
        assert_eq!(handshake(&server, &apiserver).await.unwrap(), renewed);
    }

    #[tokio::test]
    async fn callers_without_a_certificate_from_the_client_ca_are_refused() {
        let (serving_ca, client_ca, stranger_ca) = (Ca::new("serving-ca"), Ca::new("client-ca"), Ca::new("stranger"));
        let (cert, key) = serving_ca.issue("system:node:tidepool", &[ADDRESS]);
        let resolver = Arc::new(ServingCert::new(Arc::new(certified_key(vec![cert], key).unwrap())));
        let server = Arc::new(server_config(resolver, client_ca.roots()).unwrap());
        let anonymous = client(&serving_ca, None);
        assert!(handshake(&server, &anonymous).await.unwrap_err().starts_with("server:"));
        let stranger = client(&serving_ca, Some(stranger_ca.issue("someone", &[])));
        assert!(handshake(&server, &stranger).await.unwrap_err().starts_with("server:"));
    }

    #[test]
    fn a_ca_bundle_without_a_certificate_is_refused() {
        assert!(roots_from_pem(b"").is_err());
        assert!(roots_from_pem(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n").is_err());
        let (a, b) = (Ca::new("a"), Ca::new("b"));
        assert_eq!(roots_from_pem(format!("{}{}", a.pem, b.pem).as_bytes()).unwrap().len(), 2);
    }
}
