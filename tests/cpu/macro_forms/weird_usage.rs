// Unusual but valid uses: raw identifiers, nested and shadowing items, nested
// profiled functions, closures left alone, a re-exported crate path.
#![forbid(unsafe_code)]

mod reexport {
    pub use memlab as profiling;
}

#[memlab::profile]
fn r#match(r#type: u8) -> u8 {
    r#type
}

#[memlab::profile]
fn with_nested_items() -> usize {
    fn helper() -> usize {
        2
    }
    struct Local(usize);
    const K: usize = 3;

    #[memlab::profile]
    fn nested_profiled() -> usize {
        1
    }

    let add = |x: usize| x + 1;
    Local(helper()).0 + K + nested_profiled() + add(0)
}

#[reexport::profiling::profile(crate = reexport::profiling)]
fn through_reexport() -> u8 {
    7
}

#[memlab::profile]
fn labelled_blocks(n: u32) -> u32 {
    let v = 'outer: {
        for i in 0..n {
            if i == 2 {
                break 'outer i;
            }
        }
        n
    };
    const { assert!(1 + 1 == 2) };
    v
}

#[test]
fn builds_and_runs() {
    let _s = crate::common::serial();
    assert_eq!(r#match(4), 4);
    assert_eq!(with_nested_items(), 7);
    assert_eq!(through_reexport(), 7);
    assert_eq!(labelled_blocks(5), 2);
    let report = memlab::report();
    assert!(report.function("r#match").is_ok_and(|f| f.ran()));
    assert!(report.function("nested_profiled").is_ok_and(|f| f.ran()));
    assert!(report.function("through_reexport").is_ok_and(|f| f.ran()));
}
