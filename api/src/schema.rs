//! The `MemberCluster` CRD as tidepool serves it: the schema derived from the types in
//! [`crate::crd`], tightened so the API server refuses at `kubectl apply` what needs no
//! context — patterns, ranges, enums and CEL rules (quantities with `isQuantity`, pool names
//! unique through `x-kubernetes-list-type: map`) — with a message naming the field. What
//! only the controller can judge (a schedule's values, a virtual node name's length, the
//! Secret) stays `InvalidSpec` ([`crate::MemberClusterSpec::validate`]).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSON, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool, ValidationRule,
};
use kube::CustomResourceExt;

use crate::crd::MemberCluster;

/// DNS-1123 label.
const DNS_LABEL: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// DNS-1123 subdomain.
const DNS_SUBDOMAIN: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
/// A macro, or five cron fields of digits, names and `* ? , - /`; their values are the
/// controller's to judge.
const CRON_SHAPE: &str = r"^\s*(@[a-zA-Z]+|[0-9a-zA-Z*?,/-]+(\s+[0-9a-zA-Z*?,/-]+){4})\s*$";
/// An amount of a reserve map is a non-negative quantity (int-or-string, hence `string()`).
const QUANTITY: &str = "isQuantity(string(self)) && !quantity(string(self)).isLessThan(quantity('0'))";

/// The CRD `tidepool crds` prints, `deploy/crds/` holds and the tests install.
pub fn member_cluster_crd() -> CustomResourceDefinition {
    let mut crd = MemberCluster::crd();
    crd.spec.names.categories = Some(vec!["tidepool".to_owned()]);
    for version in &mut crd.spec.versions {
        if let Some(root) = version.schema.as_mut().and_then(|s| s.open_api_v3_schema.as_mut()) {
            drop_unknown_formats(root);
            tighten(root);
        }
    }
    crd
}

/// The schema node at `path`: property names, `[]` for a list's items, `{}` for a map's values.
fn at<'a>(mut node: &'a mut JSONSchemaProps, path: &[&str]) -> Option<&'a mut JSONSchemaProps> {
    for step in path {
        node = match *step {
            "[]" => match node.items.as_mut()? {
                JSONSchemaPropsOrArray::Schema(s) => s.as_mut(),
                JSONSchemaPropsOrArray::Schemas(_) => return None,
            },
            "{}" => match node.additional_properties.as_mut()? {
                JSONSchemaPropsOrBool::Schema(s) => s.as_mut(),
                JSONSchemaPropsOrBool::Bool(_) => return None,
            },
            name => node.properties.as_mut()?.get_mut(name)?,
        };
    }
    Some(node)
}

fn rule(node: &mut JSONSchemaProps, rule: &str, message: &str) {
    node.x_kubernetes_validations.get_or_insert_with(Vec::new).push(ValidationRule {
        rule: rule.to_owned(),
        message: Some(message.to_owned()),
        ..Default::default()
    });
}

fn pattern(node: &mut JSONSchemaProps, regex: &str, max_length: i64) {
    node.pattern = Some(regex.to_owned());
    node.max_length = Some(max_length);
}

fn one_of(node: &mut JSONSchemaProps, values: &[&str]) {
    node.enum_ = Some(values.iter().map(|v| JSON(serde_json::Value::String((*v).to_owned()))).collect());
}

fn range(node: &mut JSONSchemaProps, min: f64, max: f64) {
    node.minimum = Some(min);
    node.maximum = Some(max);
}

/// Applies `f` to the node at `path`; a path the types no longer have is a bug caught by the
/// unit test that every rule is attached.
fn with(root: &mut JSONSchemaProps, path: &[&str], f: impl FnOnce(&mut JSONSchemaProps)) {
    if let Some(node) = at(root, path) {
        f(node);
    }
}

fn tighten(root: &mut JSONSchemaProps) {
    root.description = Some(
        "A member (online) cluster whose surplus capacity tidepool lends to this training cluster as virtual \
         nodes, one per pool; see deploy/docs/configuration.md."
            .to_owned(),
    );
    rule(
        root,
        "size(self.metadata.name) <= 63 && self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",
        "metadata.name must be a DNS-1123 label (it names virtual nodes)",
    );
    let secret = ["spec", "kubeconfigSecretRef"];
    with(root, &[&secret[..], &["name"]].concat(), |n| pattern(n, DNS_SUBDOMAIN, 253));
    with(root, &[&secret[..], &["namespace"]].concat(), |n| pattern(n, DNS_LABEL, 63));
    with(root, &[&secret[..], &["key"]].concat(), |n| pattern(n, "^[-._a-zA-Z0-9]+$", 253));
    with(root, &["spec", "namespacePrefix"], |n| {
        rule(
            n,
            "self.matches('^[a-z][a-z0-9]*-$') && !(self in ['kube-', 'openshift-', 'default-'])",
            crate::crd::NAMESPACE_PREFIX_RULE,
        );
        n.max_length = Some(20);
    });
    capacity(root);
    // Bounds on lists, maps and strings keep the CEL rules' estimated cost within the API
    // server's budget (it refuses a schema whose worst case is unbounded).
    with(root, &["spec", "pools"], |n| n.max_items = Some(64));
    with(root, &["spec", "pools", "[]", "tolerations"], |n| n.max_items = Some(32));
    with(root, &["spec", "pools", "[]", "tolerations", "[]", "key"], |n| n.max_length = Some(317));
    with(root, &["spec", "pools", "[]", "tolerations", "[]", "value"], |n| n.max_length = Some(63));
    for list in ["copyLabels", "copyAnnotations"] {
        with(root, &["spec", list], |n| n.max_items = Some(64));
        with(root, &["spec", list, "[]"], |n| n.max_length = Some(317));
    }
    with(root, &["spec", "pools"], |n| {
        n.x_kubernetes_list_type = Some("map".to_owned());
        n.x_kubernetes_list_map_keys = Some(vec!["name".to_owned()]);
    });
    with(root, &["spec", "pools", "[]", "name"], |n| pattern(n, DNS_LABEL, 63));
    with(root, &["spec", "pools", "[]", "runtimeClassNames", "[]"], |n| pattern(n, DNS_SUBDOMAIN, 253));
    with(root, &["spec", "pools", "[]", "topology"], |n| {
        n.max_items = Some(8);
        n.x_kubernetes_list_type = Some("set".to_owned());
    });
    with(root, &["spec", "pools", "[]", "topology", "[]"], |n| {
        pattern(
            n,
            r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
            317,
        );
    });
    with(root, &["spec", "pools", "[]", "tolerations", "[]"], |n| {
        rule(n, "self.operator == 'Exists' || (has(self.key) && self.key != '')", "operator Equal needs a key");
        rule(
            n,
            "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
            "operator Exists takes no value",
        );
    });
    with(root, &["spec", "pools", "[]", "tolerations", "[]", "operator"], |n| one_of(n, &["Equal", "Exists"]));
    with(root, &["spec", "pools", "[]", "tolerations", "[]", "effect"], |n| {
        one_of(n, &["", "NoSchedule", "PreferNoSchedule", "NoExecute"]);
    });
    for list in ["copyLabels", "copyAnnotations"] {
        with(root, &["spec", list, "[]"], |n| {
            rule(
                n,
                "!self.startsWith('tidepool.io/') && !self.matches('^[^/]*[.]tidepool[.]io/')",
                "tidepool.io/ keys are tidepool's own and cannot be copied from a tenant's pod",
            );
        });
    }
}

fn capacity(root: &mut JSONSchemaProps) {
    let c = ["spec", "capacity"];
    let path = |tail: &[&'static str]| [&c[..], tail].concat();
    for reserve in [&["reserve"][..], &["windows", "[]", "reserve"]] {
        with(root, &path(reserve), |n| n.max_properties = Some(32));
        with(root, &path(&[reserve, &["{}"]].concat()), |n| {
            n.max_length = Some(64);
            rule(n, QUANTITY, "must be a non-negative quantity");
        });
    }
    with(root, &path(&["windows"]), |n| n.max_items = Some(32));
    with(root, &path(&["watermarkPercent"]), |n| range(n, 1.0, 100.0));
    with(root, &path(&["hpaHeadroomPercent"]), |n| range(n, 0.0, 1000.0));
    with(root, &path(&["windows", "[]", "name"]), |n| pattern(n, DNS_LABEL, 63));
    with(root, &path(&["windows", "[]", "schedule"]), |n| pattern(n, CRON_SHAPE, 200));
    with(root, &path(&["windows", "[]", "timeZone"]), |n| {
        pattern(n, "^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+)*$", 64)
    });
    with(root, &path(&["windows", "[]", "durationMinutes"]), |n| range(n, 1.0, 1440.0));
    with(root, &path(&["windows", "[]", "leadSeconds"]), |n| range(n, 0.0, 86_400.0));
}

/// schemars names Rust's integer widths (`uint32`, …) as formats; the API server knows only
/// `int32`/`int64` and warns on the rest. The range (`minimum: 0`) says what matters.
fn drop_unknown_formats(node: &mut JSONSchemaProps) {
    if node.format.as_deref().is_some_and(|f| f.starts_with("uint") || f == "int8" || f == "int16") {
        node.format = None;
    }
    for child in node.properties.iter_mut().flat_map(|p| p.values_mut()) {
        drop_unknown_formats(child);
    }
    if let Some(JSONSchemaPropsOrArray::Schema(s)) = node.items.as_mut() {
        drop_unknown_formats(s);
    }
    if let Some(JSONSchemaPropsOrBool::Schema(s)) = node.additional_properties.as_mut() {
        drop_unknown_formats(s);
    }
    for list in [&mut node.all_of, &mut node.any_of, &mut node.one_of].into_iter().flatten() {
        list.iter_mut().for_each(drop_unknown_formats);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> JSONSchemaProps {
        member_cluster_crd().spec.versions[0].schema.clone().unwrap().open_api_v3_schema.unwrap()
    }

    #[test]
    fn every_rule_lands_on_a_field_the_types_have() {
        let mut r = root();
        let has_rule = |n: &JSONSchemaProps| n.x_kubernetes_validations.as_ref().is_some_and(|v| !v.is_empty());
        for path in [
            &["spec", "namespacePrefix"][..],
            &["spec", "capacity", "reserve", "{}"],
            &["spec", "capacity", "windows", "[]", "reserve", "{}"],
            &["spec", "pools", "[]", "tolerations", "[]"],
            &["spec", "copyLabels", "[]"],
            &["spec", "copyAnnotations", "[]"],
        ] {
            assert!(at(&mut r, path).is_some_and(|n| has_rule(n)), "no rule at {path:?}");
        }
        for path in [
            &["spec", "kubeconfigSecretRef", "name"][..],
            &["spec", "pools", "[]", "name"],
            &["spec", "capacity", "windows", "[]", "schedule"],
        ] {
            assert!(at(&mut r, path).is_some_and(|n| n.pattern.is_some()), "no pattern at {path:?}");
        }
        let w = at(&mut r, &["spec", "capacity", "watermarkPercent"]).unwrap();
        assert_eq!((w.minimum, w.maximum), (Some(1.0), Some(100.0)));
        let pools = at(&mut r, &["spec", "pools"]).unwrap();
        assert_eq!(pools.x_kubernetes_list_type.as_deref(), Some("map"));
        assert!(has_rule(&r), "metadata.name rule at the root");
        assert!(!r.description.unwrap().contains("Auto-generated"));
    }

    #[test]
    fn no_format_the_api_server_does_not_know() {
        let text = serde_json::to_string(&member_cluster_crd()).unwrap();
        for unknown in ["uint32", "uint64", "\"uint\"", "uint16", "uint8"] {
            assert!(!text.contains(unknown), "format {unknown} left in the CRD");
        }
        assert_eq!(member_cluster_crd().spec.names.categories, Some(vec!["tidepool".to_owned()]));
    }

    #[test]
    fn the_cron_shape_takes_five_fields_of_cron_characters() {
        let re = regex::Regex::new(CRON_SHAPE).unwrap();
        for ok in ["0 17 * * 1-5", "*/15 * * * *", " 0 0 1,15 * 0 ", "0 17 ? JAN-MAR mon-fri", "@daily"] {
            assert!(re.is_match(ok), "{ok}");
        }
        for bad in ["0 17 * *", "0 17 * * * *", "every day", "@ daily", "0 17 * * MON;"] {
            assert!(!re.is_match(bad), "{bad}");
        }
    }
}
