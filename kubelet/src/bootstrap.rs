//! The kubelet API's TLS from the training cluster itself, when no files are configured
//! (`kubelet.serving: csr`), the way a kubelet with `serverTLSBootstrap` gets it:
//!
//! 1. the serving certificate: a fresh key, a `kubernetes.io/kubelet-serving`
//!    CertificateSigningRequest ([`super::csr`]), watched until an admin or an approver
//!    approves it and the signer issues it; renewed with a new request at 70–80 % of its
//!    validity, swapped under the running listener; on failure the old one keeps serving;
//! 2. the client CA: the API server's `client-ca-file`, from ConfigMap
//!    `kube-system/extension-apiserver-authentication` (as aggregated API servers read it),
//!    followed as it changes.
//!
//! Tidepool never approves its own requests: who may be a node's serving identity is the
//! cluster admin's decision.

use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::PostParams;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use rustls::RootCertStore;
use rustls::pki_types::PrivateKeyDer;
use rustls::server::ServerConfig;
use rustls::sign::CertifiedKey;
use tokio::sync::watch;
use tracing::{Instrument, debug, error, info, info_span, warn};

use super::csr::{self, CsrState, ServingIdentity};
use super::{der, tls};

/// Where the API server publishes the CA of the client certificates it accepts.
pub(super) const CLIENT_CA_NAMESPACE: &str = "kube-system";
pub(super) const CLIENT_CA_CONFIGMAP: &str = "extension-apiserver-authentication";
pub(super) const CLIENT_CA_KEY: &str = "client-ca-file";

/// How long a request may wait for its certificate before a new one is made. The
/// kube-controller-manager deletes requests left pending this long, too.
const REQUEST_PATIENCE: Duration = Duration::from_secs(24 * 3600);
/// Approved but not signed for this long: say that no signer seems to run.
const SIGNER_PATIENCE: Duration = Duration::from_secs(120);
/// Longest sleep on the wall clock before looking at it again (suspend, clock steps).
const WALL_CLOCK_STEP: Duration = Duration::from_secs(600);

/// Why no certificate came of a request.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("generating the serving key and request: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("CertificateSigningRequest {name}: cannot {what}: {source}")]
    Api {
        name: String,
        what: &'static str,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("CertificateSigningRequest {name} {condition}: {reason}: {message}")]
    Refused { name: String, condition: String, reason: String, message: String },
    #[error("CertificateSigningRequest {name} was deleted before a certificate was issued")]
    Deleted { name: String },
    #[error("CertificateSigningRequest {name}: no certificate within {}h", .waited.as_secs() / 3600)]
    Timeout { name: String, waited: Duration },
    #[error("CertificateSigningRequest {name}: the issued certificate is unusable: {message}")]
    Unusable { name: String, message: String },
    #[error("CertificateSigningRequest {name}: the watch ended")]
    WatchEnded { name: String },
}

impl CertError {
    /// A stable name of the kind of failure, for logs.
    pub fn reason(&self) -> &'static str {
        match self {
            CertError::Generate(_) => "Generate",
            CertError::Api { .. } => "Api",
            CertError::Refused { .. } => "Refused",
            CertError::Deleted { .. } => "Deleted",
            CertError::Timeout { .. } => "Timeout",
            CertError::Unusable { .. } => "Unusable",
            CertError::WatchEnded { .. } => "WatchEnded",
        }
    }
}

/// A certificate issued for one of our requests, with its key.
struct Issued {
    name: String,
    key: CertifiedKey,
    not_before: Timestamp,
    not_after: Timestamp,
}

/// Keeps `tls` holding the kubelet API's server config: set once both the first certificate
/// and the client CA are known, replaced when the CA changes. Certificate renewals do not
/// replace it: they swap the key inside it. Runs until the runtime stops.
pub(super) async fn run(client: Client, identity: ServingIdentity, tls: watch::Sender<Option<Arc<ServerConfig>>>) {
    let (cert_tx, certs) = watch::channel(None);
    let (ca_tx, cas) = watch::channel(None);
    tokio::spawn(certificates(client.clone(), identity, cert_tx).instrument(info_span!("kubelet_serving_cert")));
    tokio::spawn(client_cas(client, ca_tx).instrument(info_span!("kubelet_client_ca")));
    combine(certs, cas, tls).await;
}

/// Turns the latest certificate and CA into the server config `tls` holds (see [`run`]).
async fn combine(
    mut certs: watch::Receiver<Option<Arc<CertifiedKey>>>,
    mut cas: watch::Receiver<Option<Arc<RootCertStore>>>,
    tls: watch::Sender<Option<Arc<ServerConfig>>>,
) {
    let mut resolver: Option<Arc<tls::ServingCert>> = None;
    let mut served_cas: Option<Arc<RootCertStore>> = None;
    loop {
        tokio::select! {
            changed = certs.changed() => if changed.is_err() { return },
            changed = cas.changed() => if changed.is_err() { return },
        }
        let (Some(key), Some(roots)) = (certs.borrow_and_update().clone(), cas.borrow_and_update().clone()) else {
            continue;
        };
        let resolver = match &resolver {
            Some(current) => {
                current.swap(key);
                current.clone()
            }
            None => resolver.insert(Arc::new(tls::ServingCert::new(key))).clone(),
        };
        if served_cas.as_ref().is_some_and(|served| Arc::ptr_eq(served, &roots)) {
            continue;
        }
        match tls::server_config(resolver, roots.clone()) {
            Ok(config) => {
                if served_cas.is_none() {
                    info!("kubelet API TLS ready: serving certificate issued, client CA loaded");
                }
                served_cas = Some(roots);
                tls.send_replace(Some(Arc::new(config)));
            }
            Err(error) => error!(%error, "kubelet API TLS config refused; keeping the previous one"),
        }
    }
}

/// Obtains serving certificates one after another for as long as the process runs: the
/// first, then each renewal at its due time. A failure is retried after a backoff while the
/// last certificate (if any) keeps serving.
async fn certificates(client: Client, identity: ServingIdentity, out: watch::Sender<Option<Arc<CertifiedKey>>>) {
    let api = Api::<CertificateSigningRequest>::all(client);
    let mut failures = 0u32;
    let mut expires: Option<Timestamp> = None;
    loop {
        let request = obtain(&api, &identity);
        let mut request = pin!(request);
        let obtained = match expires {
            // A renewal still waiting when the served certificate expires: say so, keep waiting.
            Some(not_after) => tokio::select! {
                obtained = &mut request => obtained,
                () = sleep_until_wall(not_after) => {
                    warn!(%not_after, "the kubelet API's serving certificate has expired and is still served: approve the pending request");
                    request.await
                }
            },
            None => request.await,
        };
        match obtained {
            Ok(issued) => {
                failures = 0;
                let renew = csr::renew_at(issued.not_before, issued.not_after, fastrand::f64());
                let first = expires.is_none();
                info!(
                    csr = %issued.name,
                    not_after = %issued.not_after,
                    renew_at = %renew,
                    "kubelet API serving certificate {}",
                    if first { "issued" } else { "renewed" }
                );
                expires = Some(issued.not_after);
                out.send_replace(Some(Arc::new(issued.key)));
                sleep_until_wall(renew).await;
            }
            Err(error) => {
                let delay = retry_delay(failures, fastrand::f64());
                failures = failures.saturating_add(1);
                error!(
                    reason = error.reason(),
                    %error,
                    retry_in_seconds = delay.as_secs(),
                    "kubelet API serving certificate not obtained; retrying with a new request"
                );
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// One request, from key to issued certificate.
async fn obtain(api: &Api<CertificateSigningRequest>, identity: &ServingIdentity) -> Result<Issued, CertError> {
    let request = csr::new_request(identity)?;
    let name = request.name.clone();
    api.create(&PostParams::default(), &csr::csr_object(&request)).await.map_err(|source| CertError::Api {
        name: name.clone(),
        what: "create",
        source: Box::new(source),
    })?;
    info!(
        csr = %name,
        signer = csr::SIGNER,
        approve = %csr::approve_command(&name),
        "kubelet API serving certificate requested; waiting for an admin or approver to approve it"
    );
    let pem = tokio::time::timeout(REQUEST_PATIENCE, wait_issued(api, &name))
        .instrument(info_span!("kubelet_csr", csr = %name))
        .await
        .map_err(|_| CertError::Timeout { name: name.clone(), waited: REQUEST_PATIENCE })??;
    let unusable = |message: String| CertError::Unusable { name: name.clone(), message };
    let chain = tls::pem_certificates(&pem).map_err(unusable)?;
    let leaf = chain.first().ok_or_else(|| unusable("no certificate in status.certificate".into()))?;
    let (not_before, not_after) = der::validity(leaf).ok_or_else(|| unusable("no readable validity window".into()))?;
    let key = tls::certified_key(chain, PrivateKeyDer::Pkcs8(request.key.clone_key()))
        .map_err(|e| unusable(format!("does not match the requested key: {e}")))?;
    Ok(Issued { name, key, not_before, not_after })
}

/// Watches request `name` until its certificate is issued (the PEM chain), or it is
/// refused or deleted.
async fn wait_issued(api: &Api<CertificateSigningRequest>, name: &str) -> Result<Vec<u8>, CertError> {
    // A quorum read: a list from the API server's watch cache may not hold the request
    // created a moment ago yet, which would look like its deletion.
    let config = watcher::Config::default()
        .fields(&format!("metadata.name={name}"))
        .list_semantic(watcher::ListSemantic::MostRecent);
    let mut events = pin!(watcher(api.clone(), config).default_backoff());
    let mut approved_at: Option<tokio::time::Instant> = None;
    let mut warned_unsigned = false;
    // Whether the (re)list in progress has seen the request: a relist without it means it
    // was deleted while the watch was down, which no Delete event reports.
    let mut listed = false;
    loop {
        let unsigned = async {
            match approved_at {
                Some(at) if !warned_unsigned => tokio::time::sleep_until(at + SIGNER_PATIENCE).await,
                _ => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            event = events.next() => event,
            () = unsigned => {
                warned_unsigned = true;
                warn!(
                    "approved {}s ago but not signed: is a signer for {} running (kube-controller-manager \
                     --cluster-signing-kubelet-serving-cert-file/--cluster-signing-kubelet-serving-key-file)?",
                    SIGNER_PATIENCE.as_secs(),
                    csr::SIGNER
                );
                continue;
            }
        };
        let request = match event {
            None => return Err(CertError::WatchEnded { name: name.to_owned() }),
            Some(Err(error)) => {
                warn!(%error, "watching the request failed; retrying with backoff");
                continue;
            }
            Some(Ok(watcher::Event::Init)) => {
                listed = false;
                continue;
            }
            Some(Ok(watcher::Event::InitDone)) if !listed => {
                return Err(CertError::Deleted { name: name.to_owned() });
            }
            Some(Ok(watcher::Event::InitDone)) => continue,
            Some(Ok(watcher::Event::Delete(_))) => return Err(CertError::Deleted { name: name.to_owned() }),
            Some(Ok(watcher::Event::InitApply(request))) => {
                listed = true;
                request
            }
            Some(Ok(watcher::Event::Apply(request))) => request,
        };
        match csr::state(&request) {
            CsrState::Pending => {}
            CsrState::Approved => {
                if approved_at.is_none() {
                    info!("approved; waiting for the signer");
                    approved_at = Some(tokio::time::Instant::now());
                }
            }
            CsrState::Issued(pem) => return Ok(pem),
            CsrState::Refused { condition, reason, message } => {
                return Err(CertError::Refused { name: name.to_owned(), condition, reason, message });
            }
        }
    }
}

/// Follows the API server's client CA bundle; `out` holds the last one that parsed.
async fn client_cas(client: Client, out: watch::Sender<Option<Arc<RootCertStore>>>) {
    let api = Api::<ConfigMap>::namespaced(client, CLIENT_CA_NAMESPACE);
    let config = watcher::Config::default().fields(&format!("metadata.name={CLIENT_CA_CONFIGMAP}"));
    let mut events = pin!(watcher(api, config).default_backoff());
    let source = format!("ConfigMap {CLIENT_CA_NAMESPACE}/{CLIENT_CA_CONFIGMAP} key {CLIENT_CA_KEY}");
    let mut last: Option<String> = None;
    let mut listed = false;
    while let Some(event) = events.next().await {
        let map = match event {
            Err(error) => {
                warn!(%error, "reading {source} failed; retrying with backoff");
                continue;
            }
            Ok(watcher::Event::Init) => {
                listed = false;
                continue;
            }
            Ok(watcher::Event::InitDone) => {
                if !listed && last.is_none() {
                    warn!(
                        "{source} not found: the kubelet API waits for it (or set kubelet.clientCaFile with \
                         tlsCertFile and tlsKeyFile)"
                    );
                }
                continue;
            }
            Ok(watcher::Event::Delete(_)) => {
                warn!("{source} was deleted; keeping the CA read last");
                continue;
            }
            Ok(watcher::Event::InitApply(map)) => {
                listed = true;
                map
            }
            Ok(watcher::Event::Apply(map)) => map,
        };
        let Some(pem) = client_ca_pem(&map) else {
            warn!("{source} is missing; keeping the CA read last");
            continue;
        };
        if last.as_deref() == Some(pem) {
            debug!("client CA unchanged");
            continue;
        }
        match tls::roots_from_pem(pem.as_bytes()) {
            Ok(roots) => {
                info!(
                    cas = roots.len(),
                    "kubelet API client CA {} from {source}",
                    if last.is_none() { "read" } else { "reloaded" }
                );
                last = Some(pem.to_owned());
                out.send_replace(Some(Arc::new(roots)));
            }
            Err(error) => error!(%error, "{source} holds no usable CA; keeping the CA read last"),
        }
    }
}

/// The API server's client CA bundle in `map`, if it has one.
fn client_ca_pem(map: &ConfigMap) -> Option<&str> {
    map.data.as_ref()?.get(CLIENT_CA_KEY).map(String::as_str).filter(|pem| !pem.trim().is_empty())
}

/// How long to wait before request number `failures + 1`: 10 s doubling up to 5 min, then
/// `jitter` (0–1) adds up to a fifth, so replicas that failed together do not retry together.
fn retry_delay(failures: u32, jitter: f64) -> Duration {
    let base = Duration::from_secs(10).saturating_mul(1u32 << failures.min(5)).min(Duration::from_secs(300));
    base.mul_f64(1.0 + 0.2 * jitter.clamp(0.0, 1.0))
}

/// Sleeps until the wall clock reads `at`, looking at it again at least every
/// [`WALL_CLOCK_STEP`] so a suspended machine or a stepped clock does not oversleep.
async fn sleep_until_wall(at: Timestamp) {
    loop {
        let Ok(left) = Duration::try_from(at.duration_since(Timestamp::now())) else { return };
        if left.is_zero() {
            return;
        }
        tokio::time::sleep(left.min(WALL_CLOCK_STEP)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::super::tls::testing::{ADDRESS, Ca, client, handshake};
    use super::*;

    /// Lets the spawned task take what was just sent (a current-thread runtime runs it at
    /// the next yield).
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn the_config_waits_for_both_swaps_renewed_certificates_and_is_rebuilt_for_a_new_ca() {
        let (serving_ca, client_ca, rotated_ca) = (Ca::new("signer"), Ca::new("client-ca"), Ca::new("rotated"));
        let key = |ca: &Ca| {
            let (cert, key) = ca.issue("system:node:tidepool", &[ADDRESS]);
            (cert.clone(), Arc::new(tls::certified_key(vec![cert], key).unwrap()))
        };
        let (cert_tx, certs) = watch::channel(None);
        let (ca_tx, cas) = watch::channel(None);
        let (tls_tx, mut tls_rx) = watch::channel(None);
        let task = tokio::spawn(combine(certs, cas, tls_tx));

        // 1. A certificate alone serves nothing: callers must be checked against a CA.
        let (first, first_key) = key(&serving_ca);
        cert_tx.send_replace(Some(first_key));
        settle().await;
        assert!(tls_rx.borrow_and_update().is_none());

        // 2. With the CA, a config.
        ca_tx.send_replace(Some(client_ca.roots()));
        settle().await;
        let config = tls_rx.borrow_and_update().clone().unwrap();
        let apiserver = client(&serving_ca, Some(client_ca.issue("kube-apiserver-kubelet-client", &[])));
        assert_eq!(handshake(&config, &apiserver).await.unwrap(), first);

        // 3. A renewal keeps the config and changes what its next handshake serves.
        let (renewed, renewed_key) = key(&serving_ca);
        cert_tx.send_replace(Some(renewed_key));
        settle().await;
        assert!(!tls_rx.has_changed().unwrap(), "a renewal must not replace the config");
        assert_eq!(handshake(&config, &apiserver).await.unwrap(), renewed);

        // 4. A new CA makes a new config that trusts it, with the renewed certificate.
        ca_tx.send_replace(Some(rotated_ca.roots()));
        settle().await;
        let rotated = tls_rx.borrow_and_update().clone().unwrap();
        assert!(!Arc::ptr_eq(&rotated, &config));
        assert!(handshake(&rotated, &apiserver).await.is_err(), "the old client CA is no longer trusted");
        let rotated_client = client(&serving_ca, Some(rotated_ca.issue("kube-apiserver-kubelet-client", &[])));
        assert_eq!(handshake(&rotated, &rotated_client).await.unwrap(), renewed);

        // 5. Both sources gone: the task ends, the config stays.
        drop((cert_tx, ca_tx));
        task.await.unwrap();
        assert!(tls_rx.borrow().is_some());
    }

    #[test]
    fn retries_back_off_from_ten_seconds_to_five_minutes() {
        let secs = |failures| retry_delay(failures, 0.0).as_secs();
        assert_eq!([secs(0), secs(1), secs(2), secs(3), secs(4), secs(5), secs(30)], [10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(retry_delay(0, 1.0), Duration::from_secs(12), "jitter adds up to a fifth");
        assert_eq!(retry_delay(u32::MAX, 1.0), Duration::from_secs(360));
    }

    #[test]
    fn the_client_ca_is_the_client_ca_file_key() {
        let map = |data: &[(&str, &str)]| ConfigMap {
            data: Some(data.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..ConfigMap::default()
        };
        assert_eq!(
            client_ca_pem(&map(&[("client-ca-file", "PEM"), ("requestheader-client-ca-file", "X")])),
            Some("PEM")
        );
        assert_eq!(client_ca_pem(&map(&[("requestheader-client-ca-file", "X")])), None);
        assert_eq!(client_ca_pem(&map(&[("client-ca-file", " \n")])), None);
        assert_eq!(client_ca_pem(&ConfigMap::default()), None);
    }

    /// An issued chain is checked against the requested key: a certificate for another key
    /// is refused, the right one makes a `CertifiedKey`.
    #[test]
    fn an_issued_certificate_must_be_for_the_requested_key() {
        let identity =
            ServingIdentity { node_name: "tidepool".into(), ips: vec!["10.0.0.1".parse().unwrap()], dns_names: vec![] };
        let request = csr::new_request(&identity).unwrap();
        let ca_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let issuer = rcgen::Issuer::new(ca_params, &ca_key);
        let ours = rcgen::KeyPair::try_from(&request.key).unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["10.0.0.1".to_owned()]).unwrap();
        let good = leaf.signed_by(&ours, &issuer).unwrap();
        let other = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let bad = leaf.signed_by(&other, &issuer).unwrap();
        let key = || PrivateKeyDer::Pkcs8(request.key.clone_key());
        assert!(tls::certified_key(tls::pem_certificates(good.pem().as_bytes()).unwrap(), key()).is_ok());
        assert!(tls::certified_key(tls::pem_certificates(bad.pem().as_bytes()).unwrap(), key()).is_err());
        assert!(tls::certified_key(Vec::new(), key()).is_err());
    }
}
