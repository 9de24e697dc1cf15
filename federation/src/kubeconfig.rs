//! Member credentials: a kubeconfig stored in a Secret, checked before anything dials.
//!
//! Kubeconfigs that run programs (`exec`, `auth-provider`) are refused: a Secret in the
//! training cluster must never make tidepool execute something. Error messages never
//! contain the kubeconfig's content.

use kube::config::{KubeConfigOptions, Kubeconfig};

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
    #[error("kubeconfig has no usable context: {0}")]
    Context(String),
}

impl KubeconfigError {
    /// Stable reason for a status condition.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Syntax { .. } | Self::Context(_) => "KubeconfigInvalid",
            Self::ExecPlugin { .. } | Self::AuthProvider { .. } | Self::FileReference { .. } => "KubeconfigRejected",
        }
    }
}

/// Parses and vets a member kubeconfig and turns it into a client configuration.
pub async fn client_config(bytes: &[u8]) -> Result<kube::Config, KubeconfigError> {
    let text = std::str::from_utf8(bytes).map_err(|_| KubeconfigError::Syntax { line: 0 })?;
    // serde errors can quote the offending value, so only the position is kept.
    let kubeconfig: Kubeconfig = serde_yaml::from_str(text)
        .map_err(|e| KubeconfigError::Syntax { line: e.location().map_or(0, |l| l.line()) })?;
    vet(&kubeconfig)?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| KubeconfigError::Context(redact(&e.to_string())))
}

/// Refuses plugin-based and file-based credentials.
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
        if named.cluster.as_ref().is_some_and(|c| c.certificate_authority.is_some()) {
            return Err(KubeconfigError::FileReference { user: named.name.clone(), field: "certificate-authority" });
        }
    }
    Ok(())
}

/// Keeps an error message to its first line and cuts anything that looks like key material.
fn redact(message: &str) -> String {
    let first = message.lines().next().unwrap_or_default();
    if first.contains("BEGIN") || first.len() > 300 {
        "invalid credentials in kubeconfig".to_owned()
    } else {
        first.to_owned()
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
  cluster: {server: "https://127.0.0.1:6444", insecure-skip-tls-verify: true}
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
