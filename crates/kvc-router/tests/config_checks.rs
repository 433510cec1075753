//! Configurations that cannot route, or that name one worker's address twice, are refused at
//! startup with an error naming the entries.

use kvc_router::{ConfigError, RouterConfig};

/// A `[[workers]]` entry: `extra` lines appended.
fn worker(id: u32, role: &str, extra: &str) -> String {
    format!(
        "[[workers]]\nid = {id}\nrole = \"{role}\"\ncapacity-tokens = 1000\n\
         snapshot = \"/dev/shm/w{id}.snap\"\n{extra}"
    )
}

/// The message of the `Invalid` error `toml` is refused with.
fn refused(toml: &str) -> String {
    match RouterConfig::from_toml_str(toml) {
        Err(ConfigError::Invalid(m)) => m,
        other => panic!("not refused as invalid: {other:?}\n{toml}"),
    }
}

#[test]
fn roles_that_cannot_route_are_refused_naming_the_workers() {
    let decode_only = [
        worker(1, "decode", "name = \"d1\"\n"),
        worker(2, "decode", ""),
    ]
    .concat();
    let m = refused(&decode_only);
    assert!(m.contains("decode workers but no prefill worker"), "{m}");
    assert!(m.contains("1 (`d1`)") && m.contains("2 (`w2`)"), "{m}");
    assert!(m.contains("prefill: none"), "{m}");

    let prefill_only = worker(0, "prefill", "");
    let m = refused(&prefill_only);
    assert!(m.contains("prefill workers but no decode worker"), "{m}");
    assert!(m.contains("0 (`w0`)"), "{m}");

    let mixed = [
        worker(0, "prefill", ""),
        worker(1, "decode", ""),
        worker(2, "colocated", ""),
    ]
    .concat();
    let m = refused(&mixed);
    assert!(m.contains("colocated workers mixed"), "{m}");
    assert!(m.contains("colocated: 2 (`w2`)"), "{m}");

    // What can route is accepted: P/D, all colocated, and no worker at all.
    for ok in [
        [worker(0, "prefill", ""), worker(1, "decode", "")].concat(),
        [worker(0, "colocated", ""), worker(1, "colocated", "")].concat(),
        String::new(),
    ] {
        RouterConfig::from_toml_str(&ok).unwrap();
    }
}

#[test]
fn a_worker_address_given_twice_is_refused_naming_both_workers() {
    let pair = |p: &str, d: &str| [worker(0, "prefill", p), worker(1, "decode", d)].concat();
    let cases = [
        (
            pair(
                "http-url = \"http://10.0.0.1:30000\"\n",
                "http-url = \"http://10.0.0.1:30000/\"\n",
            ),
            "http-url",
        ),
        (
            pair(
                "http-url = \"http://Host:30000/v1\"\n",
                "http-url = \"http://host:30000/v1/\"\n",
            ),
            "http-url",
        ),
        (
            pair(
                "address = \"http://10.0.0.1:50060\"\n",
                "address = \"http://10.0.0.1:50060/\"\n",
            ),
            "address",
        ),
        (pair("name = \"gpu-a\"\n", "name = \"gpu-a\"\n"), "name"),
        (
            pair(
                "engine = \"vllm\"\nmetrics-url = \"http://10.0.0.1:8000/metrics\"\n",
                "engine = \"vllm\"\nmetrics-url = \"http://10.0.0.1:8000/metrics/\"\n",
            ),
            "metrics-url",
        ),
        (
            pair(
                "engine = \"vllm\"\nmetrics-url = \"http://a:1/metrics\"\nkv-events = \"tcp://h:5557\"\n",
                "engine = \"vllm\"\nmetrics-url = \"http://b:1/metrics\"\nkv-events = \"tcp://h:5557\"\n",
            ),
            "kv-events endpoint",
        ),
        // An explicit name equal to another worker's default one.
        (pair("", "name = \"w0\"\n"), "name"),
    ];
    for (toml, what) in cases {
        let m = refused(&toml);
        assert!(m.contains(&format!("the same {what}")), "{what}: {m}");
        assert!(m.contains("workers 0 (`") && m.contains("and 1 (`"), "{m}");
    }
    // The same snapshot file, spelled differently.
    let toml = [
        worker(0, "prefill", ""),
        worker(1, "decode", ""),
        "[[workers]]\nid = 2\nrole = \"decode\"\ncapacity-tokens = 1000\n\
         snapshot = \"/dev/shm/./w1.snap\"\n"
            .to_owned(),
    ]
    .concat();
    let m = refused(&toml);
    assert!(
        m.contains("the same snapshot") && m.contains("/dev/shm/w1.snap"),
        "{m}"
    );
    assert!(m.contains("workers 1 (`w1`) and 2 (`w2`)"), "{m}");
    // Two prefill workers on one host with one bootstrap port (the default, 8998).
    let toml = [
        worker(0, "prefill", "http-url = \"http://10.0.0.1:30000\"\n"),
        worker(1, "prefill", "http-url = \"http://10.0.0.1:30001\"\n"),
        worker(2, "decode", ""),
    ]
    .concat();
    let m = refused(&toml);
    assert!(
        m.contains("the same bootstrap server `10.0.0.1:8998`"),
        "{m}"
    );
    // Distinct bootstrap ports (or hosts) are fine.
    let toml = toml.replacen(
        "http-url = \"http://10.0.0.1:30001\"\n",
        "http-url = \"http://10.0.0.1:30001\"\nbootstrap-port = 8999\n",
        1,
    );
    RouterConfig::from_toml_str(&toml).unwrap();
}

#[test]
fn session_header_lists_are_checked() {
    let base = [worker(0, "prefill", ""), worker(1, "decode", "")].concat();
    let with = |http: &str| format!("[http]\n{http}\n{base}");
    let cfg = RouterConfig::from_toml_str(&base).unwrap();
    assert_eq!(
        cfg.http.session_headers,
        kvc_router::HttpConfig::DEFAULT_SESSION_HEADERS
    );
    assert_eq!(
        cfg.http.session_agent_headers,
        kvc_router::HttpConfig::DEFAULT_AGENT_HEADERS
    );
    let own = RouterConfig::from_toml_str(&with(
        "session-headers = [\"x-conversation\"]\nsession-agent-headers = []",
    ))
    .unwrap();
    assert_eq!(own.http.session_headers, ["x-conversation"]);
    assert!(own.http.session_agent_headers.is_empty());

    let m = refused(&with("session-headers = [\"x bad\"]"));
    assert!(
        m.contains("http.session-headers: `x bad` is not an HTTP header name"),
        "{m}"
    );
    let m = refused(&with("session-headers = [\"X-A\", \"x-a\"]"));
    assert!(m.contains("`x-a` is listed twice"), "{m}");
    let m = refused(&with(
        "session-headers = [\"x-a\"]\nsession-agent-headers = [\"x-a\"]",
    ));
    assert!(
        m.contains("http.session-agent-headers: `x-a` is listed twice"),
        "{m}"
    );
    let many: Vec<String> = (0..33).map(|i| format!("\"x-{i}\"")).collect();
    let m = refused(&with(&format!("session-headers = [{}]", many.join(", "))));
    assert!(m.contains("lists 33 headers, at most 32"), "{m}");
}
