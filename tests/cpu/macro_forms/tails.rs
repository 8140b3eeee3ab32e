// Block tails that `#[memlab::profile]` wraps so that its closing-brace guard
// is armed only once the tail produced the block's value: they must keep
// their types, coercions and borrows, and raise no warning.
#![deny(warnings)]

trait Shape {
    fn area(&self) -> f64;
}

struct Square(f64);

impl Shape for Square {
    fn area(&self) -> f64 {
        self.0 * self.0
    }
}

#[memlab::profile]
fn unsized_tail(side: f64) -> Box<dyn Shape> {
    let doubled = side * 2.0;
    Box::new(Square(doubled))
}

#[memlab::profile]
fn inferred_tail() -> Vec<u32> {
    let n = 3;
    (0..n).collect()
}

#[memlab::profile]
fn returning_tail(x: u32) -> u32 {
    let y = x + 1;
    return y;
}

#[memlab::profile]
fn diverging_tail(x: u32) -> u32 {
    let y = x + 1;
    if y == 0 {
        let message = "never";
        panic!("{message}")
    }
    y
}

#[memlab::profile]
fn never_returns() -> ! {
    let code = 0;
    std::process::exit(code)
}

#[memlab::profile]
fn borrowing_tails(v: &[u8]) -> usize {
    let owned: &String = {
        let n = v.len();
        &n.to_string()
    };
    let pair = {
        let m = 2;
        (&m.to_string(), [&String::from("x")])
    };
    owned.len() + pair.0.len() + pair.1[0].len()
}

#[memlab::profile]
fn search(stop: u32) -> Option<u32> {
    for i in 0..4 {
        let square = i * i;
        if square >= stop {
            return Some(i);
        }
    }
    None
}

#[test]
fn builds_and_runs() {
    let _s = crate::common::serial();
    assert_eq!(unsized_tail(1.5).area(), 9.0);
    assert_eq!(inferred_tail(), vec![0, 1, 2]);
    assert_eq!(returning_tail(1), 2);
    assert_eq!(diverging_tail(1), 2);
    assert_eq!(borrowing_tails(&[1, 2]), 3);
    assert_eq!(search(4), Some(2));
    if std::hint::black_box(false) {
        never_returns();
    }
}
