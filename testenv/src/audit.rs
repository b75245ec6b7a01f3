//! The API server's audit log ([`crate::cluster::ControlPlane::audit_events`]) read as what
//! one identity did, and the checks a security review makes of it.

use serde_json::Value;

/// One answered request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub user: String,
    pub verb: String,
    pub resource: String,
    pub namespace: String,
    pub name: String,
    pub code: i64,
    /// RBAC refused it (the authorizer's decision), as opposed to a 403 from admission, such
    /// as a write into a namespace being deleted.
    pub forbidden: bool,
}

impl std::fmt::Display for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Request {
            user,
            verb,
            resource,
            namespace,
            name,
            code,
            forbidden,
        } = self;
        let refused = if *forbidden { " (RBAC)" } else { "" };
        write!(
            f,
            "{user}: {verb} {resource} {namespace}/{name} -> {code}{refused}"
        )
    }
}

/// The requests `user` made, as the log has them.
pub fn requests_of(events: &[Value], user: &str) -> Vec<Request> {
    let text = |v: &Value, path: &str| {
        v.pointer(path)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    events
        .iter()
        .filter(|e| text(e, "/user/username") == user)
        .map(|e| Request {
            user: user.to_string(),
            verb: text(e, "/verb"),
            resource: match text(e, "/objectRef/subresource").as_str() {
                "" => text(e, "/objectRef/resource"),
                sub => format!("{}/{sub}", text(e, "/objectRef/resource")),
            },
            namespace: text(e, "/objectRef/namespace"),
            name: text(e, "/objectRef/name"),
            code: e
                .pointer("/responseStatus/code")
                .and_then(Value::as_i64)
                .unwrap_or_default(),
            forbidden: text(e, "/annotations/authorization.k8s.io~1decision") == "forbid",
        })
        .collect()
}

/// The namespaces that hold the cluster's own workloads.
pub const CLUSTER_NAMESPACES: [&str; 3] = ["kube-system", "kube-public", "kube-node-lease"];

/// What in `requests` breaks the operator's promises: it read (get, list, watch) a Secret
/// other than its own in `own_namespace` (`own_secrets`), it touched one of the cluster's own
/// namespaces, or RBAC refused it anything.
pub fn operator_breaches(
    requests: &[Request],
    own_namespace: &str,
    own_secrets: &[&str],
) -> Vec<String> {
    requests
        .iter()
        .filter(|r| {
            let read = matches!(r.verb.as_str(), "get" | "list" | "watch");
            let own = r.namespace == own_namespace && own_secrets.contains(&r.name.as_str());
            (r.resource == "secrets" && read && !own)
                || CLUSTER_NAMESPACES.contains(&r.namespace.as_str())
                || r.forbidden
        })
        .map(Request::to_string)
        .collect()
}

/// What in `requests` goes beyond an identity confined to `namespace`: a request RBAC refused,
/// or one about another namespace or a cluster-scoped object.
pub fn confinement_breaches(requests: &[Request], namespace: &str) -> Vec<String> {
    requests
        .iter()
        .filter(|r| r.forbidden || r.namespace != namespace)
        .map(Request::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(user: &str, verb: &str, resource: &str, ns: &str, name: &str, code: i64) -> Value {
        let decision = if code == 403 { "forbid" } else { "allow" };
        serde_json::json!({
            "user": {"username": user}, "verb": verb,
            "objectRef": {"resource": resource, "namespace": ns, "name": name},
            "responseStatus": {"code": code},
            "annotations": {"authorization.k8s.io/decision": decision}
        })
    }

    #[test]
    fn a_read_of_someone_elses_secret_or_a_refusal_is_a_breach() {
        let op = "system:serviceaccount:stoker-system:stoker";
        let events = [
            event(op, "get", "secrets", "stoker-system", "stoker-ca", 200),
            event(op, "patch", "secrets", "team-a", "p-decoders-tls", 200),
            event(op, "get", "secrets", "team-a", "s3-keys", 200),
            event(op, "list", "pods", "kube-system", "", 200),
            event(op, "list", "nodes", "", "", 403),
            event("someone-else", "get", "secrets", "team-a", "s3-keys", 200),
        ];
        // Admission's 403 (a namespace being deleted) is no breach of RBAC.
        let mut terminating = event(op, "create", "secrets", "team-a", "p-decoders-tls", 403);
        terminating["annotations"]["authorization.k8s.io/decision"] = "allow".into();
        let events = [events.as_slice(), &[terminating]].concat();
        let requests = requests_of(&events, op);
        assert_eq!(requests.len(), 6);
        let breaches = operator_breaches(&requests, "stoker-system", &["stoker-ca"]);
        assert_eq!(
            breaches,
            [
                format!("{op}: get secrets team-a/s3-keys -> 200"),
                format!("{op}: list pods kube-system/ -> 200"),
                format!("{op}: list nodes / -> 403 (RBAC)"),
            ]
        );
        let sidecar = [
            Request {
                namespace: "team-a".into(),
                ..requests[1].clone()
            },
            requests[3].clone(),
        ];
        assert_eq!(confinement_breaches(&sidecar, "team-a").len(), 1);
    }
}
