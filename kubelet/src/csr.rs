//! What the kubelet API asks the training cluster for when no certificate files are
//! configured, as a kubelet with `serverTLSBootstrap` does: a fresh ECDSA P-256 key, a
//! PKCS#10 request for it, the `certificates.k8s.io/v1` CertificateSigningRequest carrying
//! it, what that object's status says, and when the issued certificate is renewed. Pure:
//! the watch and the swap are in [`super::bootstrap`].
//!
//! The `kubernetes.io/kubelet-serving` signer (kube-controller-manager) signs only requests
//! whose subject is `O=system:nodes, CN=system:node:<name>`, with at least one DNS or IP
//! SAN, no e-mail or URI SAN, and usages exactly `digital signature` + `server auth` (plus
//! `key encipherment` for RSA keys, which this is not). Anything else it leaves pending,
//! silently, so the request is built to that contract and tested against it.

use std::collections::BTreeMap;
use std::net::IpAddr;

use jiff::Timestamp;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{CertificateSigningRequest, CertificateSigningRequestSpec};
use kube::api::ObjectMeta;
use rustls::pki_types::PrivatePkcs8KeyDer;
use sha2::{Digest, Sha256};
use tidepool_api::bridge::KubeletConfig;

pub(super) const SIGNER: &str = "kubernetes.io/kubelet-serving";
/// ECDSA keys sign, they do not encipher: no `key encipherment` (the signer refuses it).
pub(super) const USAGES: [&str; 2] = ["digital signature", "server auth"];
/// Prefix of every request's object name; the rest is a hash of the request.
pub(super) const NAME_PREFIX: &str = "tidepool-serving-";
/// Labels on every request, so an approver (or `kubectl get csr -l …`) finds them.
pub(super) const LABELS: [(&str, &str); 2] =
    [("app.kubernetes.io/name", "tidepool"), ("app.kubernetes.io/component", "kubelet-serving")];

/// Share of the validity window after which a certificate is renewed: between the two,
/// jittered, so replicas and restarts do not renew in step.
const RENEW_FROM: f64 = 0.7;
const RENEW_TO: f64 = 0.8;

/// Who the serving certificate is for: the subject's node name and the SANs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServingIdentity {
    pub node_name: String,
    pub ips: Vec<IpAddr>,
    pub dns_names: Vec<String>,
}

impl ServingIdentity {
    pub(crate) fn from_config(config: &KubeletConfig) -> Self {
        Self {
            node_name: config.serving_node_name.clone(),
            ips: vec![config.node_address],
            dns_names: config.serving_dns_names.clone(),
        }
    }
}

/// A fresh key and the request for its certificate. The key never leaves memory.
pub(super) struct ServingRequest {
    /// The CertificateSigningRequest's object name: unique per request (a new key each time).
    pub name: String,
    pub key: PrivatePkcs8KeyDer<'static>,
    pub csr_pem: String,
}

impl std::fmt::Debug for ServingRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingRequest").field("name", &self.name).finish_non_exhaustive()
    }
}

/// Generates a key and the PKCS#10 request for `identity`.
pub(super) fn new_request(identity: &ServingIdentity) -> Result<ServingRequest, rcgen::Error> {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = rcgen::CertificateParams::default();
    let mut subject = rcgen::DistinguishedName::new();
    subject.push(rcgen::DnType::OrganizationName, "system:nodes");
    subject.push(rcgen::DnType::CommonName, format!("system:node:{}", identity.node_name));
    params.distinguished_name = subject;
    let mut sans: Vec<rcgen::SanType> = identity.ips.iter().copied().map(rcgen::SanType::IpAddress).collect();
    for name in &identity.dns_names {
        sans.push(rcgen::SanType::DnsName(name.as_str().try_into()?));
    }
    params.subject_alt_names = sans;
    let csr = params.serialize_request(&key)?;
    let digest = format!("{:x}", Sha256::digest(csr.der()));
    Ok(ServingRequest {
        name: format!("{NAME_PREFIX}{}", &digest[..16]),
        key: PrivatePkcs8KeyDer::from(key.serialize_der()),
        csr_pem: csr.pem()?,
    })
}

/// The CertificateSigningRequest object for `request`. No `expirationSeconds`: the signer's
/// `--cluster-signing-duration` decides, as for a kubelet.
pub(super) fn csr_object(request: &ServingRequest) -> CertificateSigningRequest {
    let labels: BTreeMap<String, String> = LABELS.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    CertificateSigningRequest {
        metadata: ObjectMeta { name: Some(request.name.clone()), labels: Some(labels), ..ObjectMeta::default() },
        spec: CertificateSigningRequestSpec {
            request: ByteString(request.csr_pem.clone().into_bytes()),
            signer_name: SIGNER.to_owned(),
            usages: Some(USAGES.iter().map(|u| u.to_string()).collect()),
            ..CertificateSigningRequestSpec::default()
        },
        status: None,
    }
}

/// How far a CertificateSigningRequest has come.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum CsrState {
    /// Nobody approved or denied it yet.
    Pending,
    /// Approved, not signed yet.
    Approved,
    /// The PEM chain the signer issued.
    Issued(Vec<u8>),
    /// Denied by an approver, or failed by the signer: a new request is needed.
    Refused { condition: String, reason: String, message: String },
}

/// What `csr`'s status says. A `Denied` or `Failed` condition wins over anything else.
pub(super) fn state(csr: &CertificateSigningRequest) -> CsrState {
    let Some(status) = &csr.status else { return CsrState::Pending };
    let conditions = status.conditions.as_deref().unwrap_or_default();
    let holds = |kind: &str| conditions.iter().find(|c| c.type_ == kind && c.status == "True");
    if let Some(c) = holds("Denied").or_else(|| holds("Failed")) {
        return CsrState::Refused {
            condition: c.type_.clone(),
            reason: c.reason.clone().unwrap_or_default(),
            message: c.message.clone().unwrap_or_default(),
        };
    }
    match &status.certificate {
        Some(pem) if !pem.0.is_empty() => CsrState::Issued(pem.0.clone()),
        _ if holds("Approved").is_some() => CsrState::Approved,
        _ => CsrState::Pending,
    }
}

/// The command an admin runs to approve request `name`.
pub(super) fn approve_command(name: &str) -> String {
    format!("kubectl certificate approve {name}")
}

/// When a certificate valid from `not_before` to `not_after` is renewed: at 70–80 % of its
/// validity, `jitter` (0–1) picking the point.
pub(super) fn renew_at(not_before: Timestamp, not_after: Timestamp, jitter: f64) -> Timestamp {
    let validity = not_after.duration_since(not_before).as_secs_f64().max(0.0);
    let share = RENEW_FROM + (RENEW_TO - RENEW_FROM) * jitter.clamp(0.0, 1.0);
    let offset = jiff::SignedDuration::try_from_secs_f64(validity * share).unwrap_or(jiff::SignedDuration::ZERO);
    not_before.checked_add(offset).unwrap_or(not_before)
}

#[cfg(test)]
mod tests {
    use super::super::der::{self, CONTEXT_0, SEQUENCE, SET, Tlv};
    use super::*;
    use k8s_openapi::api::certificates::v1::{CertificateSigningRequestCondition, CertificateSigningRequestStatus};
    use rustls::pki_types::pem::PemObject;

    const OID_ORGANIZATION: &[u8] = &[0x55, 0x04, 0x0a];
    const OID_COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];
    const OID_EXTENSION_REQUEST: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x09, 0x0e];
    const OID_SUBJECT_ALT_NAME: &[u8] = &[0x55, 0x1d, 0x11];
    const OID_EC_PUBLIC_KEY: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
    const OID_P256: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];

    /// The request's DER, from its PEM.
    fn der_of(request: &ServingRequest) -> Vec<u8> {
        rustls::pki_types::CertificateSigningRequestDer::from_pem_slice(request.csr_pem.as_bytes()).unwrap().to_vec()
    }

    fn identity() -> ServingIdentity {
        ServingIdentity {
            node_name: "tidepool".into(),
            ips: vec!["10.1.2.3".parse().unwrap()],
            dns_names: vec!["tidepool.example".into()],
        }
    }

    /// The request's `CertificationRequestInfo` fields: version, subject, key, attributes.
    fn info(csr_der: &[u8]) -> Vec<Tlv<'_>> {
        let request = der::single(csr_der, SEQUENCE).unwrap();
        let info = der::children(request.content).unwrap()[0];
        assert_eq!(info.tag, SEQUENCE);
        der::children(info.content).unwrap()
    }

    /// (attribute OID, value) pairs of a Name, in order.
    fn subject(csr_der: &[u8]) -> Vec<(Vec<u8>, String)> {
        let name = info(csr_der)[1];
        der::children(name.content)
            .unwrap()
            .into_iter()
            .flat_map(|rdn| {
                assert_eq!(rdn.tag, SET);
                der::children(rdn.content).unwrap()
            })
            .map(|pair| match der::children(pair.content).unwrap().as_slice() {
                [oid, value] => (oid.content.to_vec(), String::from_utf8(value.content.to_vec()).unwrap()),
                other => panic!("not an attribute: {other:?}"),
            })
            .collect()
    }

    /// The SAN extension's GeneralNames as (tag, bytes), from the extensionRequest attribute.
    fn sans(csr_der: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let attributes = info(csr_der)[3];
        assert_eq!(attributes.tag, CONTEXT_0);
        for attribute in der::children(attributes.content).unwrap() {
            let [oid, values] = der::children(attribute.content).unwrap()[..] else { panic!("attribute") };
            if oid.content != OID_EXTENSION_REQUEST {
                continue;
            }
            let extensions = der::single(values.content, SEQUENCE).unwrap();
            for extension in der::children(extensions.content).unwrap() {
                let fields = der::children(extension.content).unwrap();
                if fields[0].content == OID_SUBJECT_ALT_NAME {
                    let value = fields.last().unwrap();
                    let names = der::single(value.content, SEQUENCE).unwrap();
                    return der::children(names.content)
                        .unwrap()
                        .into_iter()
                        .map(|n| (n.tag, n.content.to_vec()))
                        .collect();
                }
            }
        }
        panic!("no subjectAltName requested")
    }

    #[test]
    fn the_subject_is_the_one_the_kubelet_serving_signer_requires() {
        let request = new_request(&identity()).unwrap();
        assert_eq!(
            subject(&der_of(&request)),
            [
                (OID_ORGANIZATION.to_vec(), "system:nodes".to_owned()),
                (OID_COMMON_NAME.to_vec(), "system:node:tidepool".to_owned())
            ]
        );
    }

    #[test]
    fn the_sans_are_the_node_address_and_the_dns_names_and_nothing_else() {
        let request = new_request(&identity()).unwrap();
        // [7] iPAddress: the four address bytes; [2] dNSName: the name.
        assert_eq!(sans(&der_of(&request)), [(0x87, vec![10, 1, 2, 3]), (0x82, b"tidepool.example".to_vec())]);
        let v6 = ServingIdentity { ips: vec!["fd00::7".parse().unwrap()], dns_names: vec![], ..identity() };
        let mut want = vec![0u8; 16];
        want[0] = 0xfd;
        want[15] = 7;
        assert_eq!(sans(&der_of(&new_request(&v6).unwrap())), [(0x87, want)]);
    }

    #[test]
    fn the_key_is_ecdsa_p256() {
        let request = new_request(&identity()).unwrap();
        let der = der_of(&request);
        let spki = info(&der)[2];
        let algorithm = der::children(spki.content).unwrap()[0];
        let oids: Vec<&[u8]> = der::children(algorithm.content).unwrap().iter().map(|t| t.content).collect();
        assert_eq!(oids, [OID_EC_PUBLIC_KEY, OID_P256]);
        assert!(request.csr_pem.starts_with("-----BEGIN CERTIFICATE REQUEST-----"));
    }

    #[test]
    fn every_request_has_its_own_key_and_name() {
        let (a, b) = (new_request(&identity()).unwrap(), new_request(&identity()).unwrap());
        assert_ne!(a.name, b.name);
        assert_ne!(a.key.secret_pkcs8_der(), b.key.secret_pkcs8_der());
        assert!(a.name.starts_with(NAME_PREFIX) && a.name.len() == NAME_PREFIX.len() + 16, "{}", a.name);
        assert!(tidepool_api::is_dns_subdomain(&a.name));
    }

    #[test]
    fn the_object_asks_the_kubelet_serving_signer_for_server_auth_only() {
        let request = new_request(&identity()).unwrap();
        let object = csr_object(&request);
        assert_eq!(object.metadata.name.as_deref(), Some(request.name.as_str()));
        assert_eq!(object.spec.signer_name, "kubernetes.io/kubelet-serving");
        assert_eq!(
            object.spec.usages.as_deref(),
            Some(&["digital signature".to_owned(), "server auth".to_owned()][..])
        );
        assert_eq!(object.spec.request.0, request.csr_pem.as_bytes());
        assert_eq!(object.spec.expiration_seconds, None);
        let labels = object.metadata.labels.unwrap();
        assert_eq!(labels.get("app.kubernetes.io/component").map(String::as_str), Some("kubelet-serving"));
    }

    fn with_status(conditions: &[(&str, &str)], certificate: Option<&str>) -> CertificateSigningRequest {
        CertificateSigningRequest {
            status: Some(CertificateSigningRequestStatus {
                certificate: certificate.map(|c| ByteString(c.as_bytes().to_vec())),
                conditions: Some(
                    conditions
                        .iter()
                        .map(|(kind, status)| CertificateSigningRequestCondition {
                            type_: kind.to_string(),
                            status: status.to_string(),
                            reason: Some(format!("{kind}Reason")),
                            message: Some(format!("{kind} message")),
                            ..CertificateSigningRequestCondition::default()
                        })
                        .collect(),
                ),
            }),
            ..CertificateSigningRequest::default()
        }
    }

    #[test]
    fn the_state_follows_the_conditions_and_the_certificate() {
        let refused = |kind: &str| CsrState::Refused {
            condition: kind.to_owned(),
            reason: format!("{kind}Reason"),
            message: format!("{kind} message"),
        };
        let cases = [
            ("no status at all is pending", CertificateSigningRequest::default(), CsrState::Pending),
            ("no condition is pending", with_status(&[], None), CsrState::Pending),
            (
                "approved without a certificate waits for the signer",
                with_status(&[("Approved", "True")], None),
                CsrState::Approved,
            ),
            (
                "an approval with status False is no approval",
                with_status(&[("Approved", "False")], None),
                CsrState::Pending,
            ),
            (
                "an empty certificate is not issued yet",
                with_status(&[("Approved", "True")], Some("")),
                CsrState::Approved,
            ),
            (
                "a certificate is issued",
                with_status(&[("Approved", "True")], Some("PEM")),
                CsrState::Issued(b"PEM".to_vec()),
            ),
            ("denied", with_status(&[("Denied", "True")], None), refused("Denied")),
            (
                "failed by the signer after approval",
                with_status(&[("Approved", "True"), ("Failed", "True")], None),
                refused("Failed"),
            ),
            (
                "failed wins over a certificate",
                with_status(&[("Approved", "True"), ("Failed", "True")], Some("PEM")),
                refused("Failed"),
            ),
        ];
        for (case, csr, want) in cases {
            assert_eq!(state(&csr), want, "{case}");
        }
    }

    #[test]
    fn renewal_falls_between_70_and_80_percent_of_the_validity() {
        let not_before: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let day = jiff::SignedDuration::from_hours(24);
        let not_after = not_before + day * 100;
        assert_eq!(renew_at(not_before, not_after, 0.0), not_before + day * 70);
        assert_eq!(renew_at(not_before, not_after, 0.5), not_before + day * 75);
        assert_eq!(renew_at(not_before, not_after, 1.0), not_before + day * 80);
        assert_eq!(renew_at(not_before, not_after, 7.0), not_before + day * 80, "jitter is clamped");
        assert_eq!(renew_at(not_after, not_before, 0.5), not_after, "a window upside down renews at once");
    }

    #[test]
    fn the_approve_command_names_the_request() {
        assert_eq!(approve_command("tidepool-serving-0123"), "kubectl certificate approve tidepool-serving-0123");
    }
}
