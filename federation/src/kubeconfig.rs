//! Member credentials: a kubeconfig stored in a Secret, checked before anything dials.
//!
//! Kubeconfigs that run programs (`exec`, `auth-provider`) are refused: a Secret in the
//! training cluster must never make tidepool execute something. Error messages never
//! contain the kubeconfig's content.

use kube::config::{KubeConfigOptions, Kubeconfig};
use tidepool_api::keys;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KubeconfigError {
    #[error("kubeconfig is not valid YAML or lacks required fields (line {line})")]
    Syntax { line: usize },
    #[error("kubeconfig user {user:?} uses an exec plugin; only certificate, token or basic credentials are accepted")]
    ExecPlugin { user: String },
    #[error(
        "kubeconfig user {user:?} uses an auth-provider plugin; only certificate, token or basic credentials are accepted"
    )]
    AuthProvider { user: String },
    #[error("kubeconfig user {user:?} reads files from tidepool's disk ({field}); embed the data instead")]
    FileReference { user: String, field: &'static str },
    #[error(
        "kubeconfig cluster {cluster:?} sets insecure-skip-tls-verify; give the member's CA in certificate-authority-data instead"
    )]
    InsecureTls { cluster: String },
    #[error("kubeconfig cluster {cluster:?} has credentials in its server URL; give them as a user instead")]
    CredentialsInUrl { cluster: String },
    #[error(
        "kubeconfig cluster {cluster:?} has a server URL that is not https://; tidepool's token would travel in clear"
    )]
    PlainServer { cluster: String },
    #[error(
        "kubeconfig cluster {cluster:?} sets proxy-url; tidepool dials member API servers directly (a proxy named in a Secret would send tidepool's connections wherever its writer chooses)"
    )]
    Proxy { cluster: String },
    #[error("kubeconfig has no usable context: {0}")]
    Context(String),
}

impl KubeconfigError {
    /// Stable reason for a status condition.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Syntax { .. } | Self::Context(_) => keys::REASON_KUBECONFIG_INVALID,
            Self::ExecPlugin { .. }
            | Self::AuthProvider { .. }
            | Self::FileReference { .. }
            | Self::InsecureTls { .. }
            | Self::CredentialsInUrl { .. }
            | Self::PlainServer { .. }
            | Self::Proxy { .. } => keys::REASON_KUBECONFIG_REJECTED,
        }
    }
}

/// Parses and vets a member kubeconfig and turns it into a client configuration.
pub async fn client_config(bytes: &[u8]) -> Result<kube::Config, KubeconfigError> {
    let text = std::str::from_utf8(bytes).map_err(|_| KubeconfigError::Syntax { line: 0 })?;
    // serde errors can quote the offending value, so only the position is kept.
    let kubeconfig: Kubeconfig = serde_saphyr::from_str(text).map_err(|e| KubeconfigError::Syntax {
        line: e.location().map_or(0, |l| usize::try_from(l.line()).unwrap_or(usize::MAX)),
    })?;
    vet(&kubeconfig)?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| KubeconfigError::Context(redact(&e.to_string())))
}

/// Refuses plugin-based and file-based credentials, connections that would not check the
/// member's certificate (anyone on the path could then act as the member's API server and
/// be handed tidepool's token), and credentials in a server URL (which ends up in status
/// messages); a server that is not `https://` (the token in clear) and a `proxy-url` (a
/// Secret's writer would choose where tidepool's connections go).
pub fn vet(kubeconfig: &Kubeconfig) -> Result<(), KubeconfigError> {
    for named in &kubeconfig.auth_infos {
        let user = named.name.clone();
        let Some(auth) = &named.auth_info else {
            continue;
        };
        if auth.exec.is_some() {
            return Err(KubeconfigError::ExecPlugin { user });
        }
        if auth.auth_provider.is_some() {
            return Err(KubeconfigError::AuthProvider { user });
        }
        for (set, field) in [
            (auth.client_certificate.is_some(), "client-certificate"),
            (auth.client_key.is_some(), "client-key"),
            (auth.token_file.is_some(), "tokenFile"),
        ] {
            if set {
                return Err(KubeconfigError::FileReference { user, field });
            }
        }
    }
    for named in &kubeconfig.clusters {
        let Some(cluster) = named.cluster.as_ref() else { continue };
        if cluster.certificate_authority.is_some() {
            return Err(KubeconfigError::FileReference { user: named.name.clone(), field: "certificate-authority" });
        }
        if cluster.insecure_skip_tls_verify == Some(true) {
            return Err(KubeconfigError::InsecureTls { cluster: named.name.clone() });
        }
        if cluster.server.as_deref().is_some_and(|s| scrub_urls(s) != s) {
            return Err(KubeconfigError::CredentialsInUrl { cluster: named.name.clone() });
        }
        if cluster.server.as_deref().is_some_and(|s| !s.to_ascii_lowercase().starts_with("https://")) {
            return Err(KubeconfigError::PlainServer { cluster: named.name.clone() });
        }
        if cluster.proxy_url.is_some() {
            return Err(KubeconfigError::Proxy { cluster: named.name.clone() });
        }
    }
    Ok(())
}

/// `text` with the user information (`user:password@`) cut out of every URL in it: for
/// anything that goes into a status, Event or log and may quote a server or proxy URL.
pub fn scrub_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        // The authority ends at the first '/', '?', '#' or whitespace; user information is
        // what comes before its last '@'.
        let end = tail.find(|c: char| matches!(c, '/' | '?' | '#') || c.is_whitespace()).unwrap_or(tail.len());
        let authority = &tail[..end];
        out.push_str(authority.rfind('@').map_or(authority, |i| &authority[i + 1..]));
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// Keeps an error message to its first line and cuts anything that looks like key material
/// or credentials in a URL.
fn redact(message: &str) -> String {
    let first = message.lines().next().unwrap_or_default();
    if first.contains("BEGIN") || first.len() > 300 {
        "invalid credentials in kubeconfig".to_owned()
    } else {
        scrub_urls(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
apiVersion: v1
kind: Config
clusters:
- name: m
  cluster: {server: "https://127.0.0.1:6444"}
contexts:
- name: m
  context: {cluster: m, user: u}
current-context: m
users:
- name: u
  user: USER
"#;

    fn with_user(user: &str) -> String {
        BASE.replace("USER", user)
    }

    #[tokio::test]
    async fn token_credentials_are_accepted() {
        assert!(client_config(with_user("{token: abc}").as_bytes()).await.is_ok());
    }

    #[tokio::test]
    async fn plugins_and_files_are_rejected_with_a_reason() {
        let cases = [
            (
                "{exec: {command: /bin/steal, apiVersion: client.authentication.k8s.io/v1}}",
                "KubeconfigRejected",
                "exec plugin",
            ),
            ("{auth-provider: {name: gcp}}", "KubeconfigRejected", "auth-provider"),
            ("{tokenFile: /etc/shadow}", "KubeconfigRejected", "tokenFile"),
        ];
        for (user, reason, text) in cases {
            let err = client_config(with_user(user).as_bytes()).await.unwrap_err();
            assert_eq!(err.reason(), reason, "{user}");
            assert!(err.to_string().contains(text), "{err}");
        }
    }

    /// Every field that names a file on tidepool's disk is refused by name, even when the
    /// file exists and holds what the field expects (the Secret's author must never make
    /// tidepool read its own files), for users and for clusters.
    #[tokio::test]
    async fn every_file_reference_is_refused_naming_its_field() {
        let dir = std::env::temp_dir();
        let file = dir.join(format!("tidepool-kubeconfig-test-{}.pem", std::process::id()));
        std::fs::write(&file, "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n").unwrap();
        let path = file.display().to_string();
        let users = [
            (format!("{{client-certificate: {path}, client-key-data: a2V5}}"), "client-certificate"),
            (format!("{{client-certificate-data: Y2VydA==, client-key: {path}}}"), "client-key"),
            (format!("{{tokenFile: {path}}}"), "tokenFile"),
        ];
        for (user, field) in users {
            let err = client_config(with_user(&user).as_bytes()).await.unwrap_err();
            assert_eq!(err.reason(), "KubeconfigRejected", "{user}");
            assert!(err.to_string().contains(&format!("({field})")), "{user}: {err}");
        }
        let cluster = with_user("{token: abc}").replace(
            r#"{server: "https://127.0.0.1:6444"}"#,
            &format!(r#"{{server: "https://127.0.0.1:6444", certificate-authority: {path}}}"#),
        );
        let err = client_config(cluster.as_bytes()).await.unwrap_err();
        assert_eq!(err.reason(), "KubeconfigRejected");
        assert!(err.to_string().contains("(certificate-authority)"), "{err}");
        let _ = std::fs::remove_file(&file);
    }

    #[tokio::test]
    async fn a_plain_http_server_and_a_proxy_are_refused() {
        for (cluster, words) in [
            (r#"{server: "http://127.0.0.1:6444"}"#, "not https://"),
            (r#"{server: "https://127.0.0.1:6444", proxy-url: "http://10.0.0.1:3128"}"#, "proxy-url"),
        ] {
            let text = with_user("{token: abc}").replace(r#"{server: "https://127.0.0.1:6444"}"#, cluster);
            let err = client_config(text.as_bytes()).await.unwrap_err();
            assert_eq!(err.reason(), "KubeconfigRejected", "{cluster}");
            assert!(err.to_string().contains(words), "{cluster}: {err}");
        }
        assert!(client_config(with_user("{token: abc}").as_bytes()).await.is_ok());
    }

    #[tokio::test]
    async fn skipping_tls_verification_is_refused() {
        let text = with_user("{token: abc}").replace(
            r#"{server: "https://127.0.0.1:6444"}"#,
            r#"{server: "https://127.0.0.1:6444", insecure-skip-tls-verify: true}"#,
        );
        let err = client_config(text.as_bytes()).await.unwrap_err();
        assert_eq!(err.reason(), "KubeconfigRejected");
        assert!(err.to_string().contains("insecure-skip-tls-verify"), "{err}");
    }

    #[tokio::test]
    async fn credentials_in_urls_never_reach_a_message() {
        let text = with_user("{token: abc}").replace("https://127.0.0.1:6444", "https://admin:hunter2@127.0.0.1:6444");
        let err = client_config(text.as_bytes()).await.unwrap_err();
        assert_eq!(err.reason(), "KubeconfigRejected");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let message = redact("error trying to connect: proxy http://proxy-user:s3cret@10.0.0.1:3128/ refused");
        assert_eq!(message, "error trying to connect: proxy http://10.0.0.1:3128/ refused");
        assert_eq!(redact("socks5h://u@h:1080 and https://ok.example/x"), "socks5h://h:1080 and https://ok.example/x");
    }

    #[tokio::test]
    async fn garbage_is_a_syntax_error_that_does_not_echo_the_input() {
        let err = client_config(b"apiVersion: v1\nclusters: [secret-value-123").await.unwrap_err();
        assert_eq!(err.reason(), "KubeconfigInvalid");
        assert!(!err.to_string().contains("secret-value-123"), "{err}");
    }

    #[tokio::test]
    async fn a_missing_context_is_reported() {
        let text = with_user("{token: abc}").replace("current-context: m", "current-context: nope");
        let err = client_config(text.as_bytes()).await.unwrap_err();
        assert_eq!(err.reason(), "KubeconfigInvalid");
    }
}
