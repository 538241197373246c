//! The architecture, checked from the sources: the network layer of `rpc-core` never names
//! the agent or anything above it; the caller's and the callee's paths (`call/`,
//! `dispatch.rs`) see the worker's state, never the `Agent` API; and in every crate the
//! modules import each other one way only (no circle anywhere in the tree). A module's imports
//! are the `crate::…` and `super::…` paths in its code (comments and `#[cfg(test)]` modules
//! aside).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, as (module path, source).
fn modules(src: &Path) -> BTreeMap<String, String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).expect("a source directory") {
            let p = e.expect("an entry").path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    files
        .into_iter()
        .map(|p| {
            let rel = p.strip_prefix(src).expect("under src").with_extension("");
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .filter(|c| c != "mod")
                .collect();
            let name = match parts.join("::").as_str() {
                "lib" | "main" => "crate".to_owned(),
                n => n.to_owned(),
            };
            (name, std::fs::read_to_string(&p).expect("readable"))
        })
        .collect()
}

/// The code of a file: without comments and without its `#[cfg(test)]` module.
fn code(source: &str) -> String {
    let body = match source.find("#[cfg(test)]\nmod ") {
        Some(i) => &source[..i],
        None => source,
    };
    body.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifier paths following `prefix` (`crate::` or `super::`) in `code`.
fn paths_after<'a>(code: &'a str, prefix: &str) -> Vec<Vec<&'a str>> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        let before = rest[..i].chars().last();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len());
        out.push(rest[..end].split("::").filter(|s| !s.is_empty()).collect());
    }
    out
}

/// Each module's imports of other modules of the same crate.
fn imports(mods: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let longest = |parts: &[&str]| -> Option<String> {
        (1..=parts.len())
            .rev()
            .map(|k| parts[..k].join("::"))
            .find(|c| mods.contains_key(c))
    };
    mods.iter()
        .map(|(m, src)| {
            let code = code(src);
            let parent: Vec<&str> = match m.rsplit_once("::") {
                Some((p, _)) => p.split("::").collect(),
                None => Vec::new(),
            };
            let mut deps = BTreeSet::new();
            for p in paths_after(&code, "crate::") {
                deps.extend(longest(&p));
            }
            for p in paths_after(&code, "super::") {
                let full: Vec<&str> = parent.iter().copied().chain(p).collect();
                deps.extend(longest(&full).or_else(|| {
                    let p = parent.join("::");
                    mods.contains_key(&p).then_some(p)
                }));
            }
            deps.remove(m);
            (m.clone(), deps)
        })
        .collect()
}

/// A circle among `within` (modules whose path starts with it), if there is one.
fn circle(deps: &BTreeMap<String, BTreeSet<String>>, within: &str) -> Option<Vec<String>> {
    let inside = |m: &str| m != "crate" && m.starts_with(within);
    fn visit(
        m: &str,
        deps: &BTreeMap<String, BTreeSet<String>>,
        inside: &dyn Fn(&str) -> bool,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            return Some(path[i..].to_vec());
        }
        if !done.insert(m.to_owned()) {
            return None;
        }
        path.push(m.to_owned());
        for d in deps.get(m).into_iter().flatten().filter(|d| inside(d)) {
            if let Some(c) = visit(d, deps, inside, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    deps.keys()
        .filter(|m| inside(m))
        .find_map(|m| visit(m, deps, &inside, &mut Vec::new(), &mut done))
}

fn src(krate: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("src")
}

#[test]
fn the_network_layer_never_names_the_agent_or_anything_above_it() {
    let mods = modules(&src("rpc-core"));
    let deps = imports(&mods);
    let above = [
        "agent",
        "blob",
        "cancel",
        "call",
        "config",
        "context",
        "dispatch",
        "ext",
        "group",
        "registry",
        "rendezvous",
        "init",
        "layers",
        "shutdown",
        "state",
        "testing",
    ];
    let net: Vec<_> = mods.keys().filter(|m| m.starts_with("net")).collect();
    assert!(net.len() > 10, "the network layer's modules: {net:?}");
    for m in net {
        let wrong: Vec<_> = deps[m]
            .iter()
            .filter(|d| above.iter().any(|a| d.split("::").next() == Some(a)))
            .collect();
        assert!(wrong.is_empty(), "`{m}` imports {wrong:?}");
        assert!(!names_agent(&mods[m]), "`{m}` names `Agent`");
    }
}

/// The `Agent` named as a word in a module's code.
fn names_agent(src: &str) -> bool {
    code(src)
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .any(|w| w == "Agent")
}

#[test]
fn the_callers_and_callees_paths_see_the_workers_state_not_the_agent() {
    let mods = modules(&src("rpc-core"));
    let paths: Vec<_> = mods
        .keys()
        .filter(|m| m.starts_with("call") || *m == "dispatch")
        .collect();
    assert!(paths.len() >= 5, "call/ and dispatch: {paths:?}");
    for m in paths {
        assert!(!names_agent(&mods[m]), "`{m}` names `Agent`");
        let deps = imports(&mods);
        assert!(!deps[m].contains("agent"), "`{m}` imports the agent module");
    }
}

#[test]
fn layers_import_one_way() {
    for (krate, within) in [
        ("rpc-core", ""),
        ("rref", ""),
        ("autograd-dist", ""),
        ("collectives", ""),
        ("rpcrun", ""),
        ("examples", ""),
    ] {
        let deps = imports(&modules(&src(krate)));
        assert!(
            circle(&deps, within).is_none(),
            "{krate}: modules import each other in a circle: {:?}",
            circle(&deps, within)
        );
    }
}

/// The checker itself finds a circle and an import from above where there are some.
#[test]
fn the_checker_sees_circles_and_imports() {
    let mods: BTreeMap<String, String> = [
        ("a", "use crate::b::X;\n// use crate::c;\n"),
        ("b", "fn f() { super::a::g() }\n"),
        (
            "c",
            "use crate::a;\n#[cfg(test)]\nmod tests { use crate::b; }\n",
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let deps = imports(&mods);
    assert_eq!(deps["a"], BTreeSet::from(["b".to_owned()]));
    assert_eq!(deps["c"], BTreeSet::from(["a".to_owned()]));
    let c = circle(&deps, "").expect("a and b form a circle");
    assert!(
        c.contains(&"a".to_owned()) && c.contains(&"b".to_owned()),
        "{c:?}"
    );
}
