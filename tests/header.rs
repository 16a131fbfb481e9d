//! The committed C header must be exactly what cbindgen generates from the sources.
//! `SO_BLESS=1 cargo test --test header` rewrites it.

#[test]
fn committed_header_is_fresh() {
    let generated = std::fs::read_to_string(concat!(env!("OUT_DIR"), "/superoffload.h")).unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/include/superoffload.h");
    if std::env::var_os("SO_BLESS").is_some() {
        std::fs::write(path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/superoffload.h is stale: regenerate it with `SO_BLESS=1 cargo test --test header` and commit it"
    );
}
