// Every kind of function the attribute must keep exactly as written.
use std::fmt::Debug;

use tch::{Kind, Tensor};

struct Model {
    scale: f64,
}

trait Forward {
    fn forward(&self, x: &Tensor) -> Tensor;
}

impl Model {
    #[memlab::profile]
    fn by_ref(&self, x: &Tensor) -> Tensor {
        x * self.scale
    }

    #[memlab::profile]
    fn by_mut(&mut self, factor: f64) {
        self.scale *= factor;
    }

    #[memlab::profile(device = "cpu")]
    fn by_value(self) -> f64 {
        self.scale
    }

    #[memlab::profile]
    pub(crate) fn associated() -> Self {
        Model { scale: 1.0 }
    }
}

impl Forward for Model {
    #[memlab::profile]
    fn forward(&self, x: &Tensor) -> Tensor {
        self.by_ref(x)
    }
}

#[memlab::profile]
fn generic<T: Debug + Clone, const N: usize>(items: [T; N]) -> Vec<T>
where
    T: Send,
{
    let v = items.to_vec();
    v
}

#[memlab::profile]
fn returns_impl_trait(n: usize) -> impl Iterator<Item = usize> {
    (0..n).map(|i| i * 2)
}

#[memlab::profile]
fn with_question_mark(text: &str) -> Result<i64, std::num::ParseIntError> {
    let n: i64 = text.parse()?;
    Ok(n * 2)
}

#[memlab::profile]
fn with_lifetimes<'a>(a: &'a str, _b: &str) -> &'a str {
    a
}

#[memlab::profile]
unsafe fn unsafe_fn(p: *const i64) -> i64 {
    unsafe { *p }
}

#[memlab::profile]
extern "C" fn c_abi(x: i32) -> i32 {
    x + 1
}

#[memlab::profile]
async fn async_fn(x: u32) -> u32 {
    std::future::ready(x).await + 1
}

#[memlab::profile]
fn diverging_else(v: Option<u8>) -> u8 {
    let Some(x) = v else {
        return 0;
    };
    x
}

#[memlab::profile_every(3, device = "cpu")]
fn periodic() -> Tensor {
    Tensor::zeros([4], (Kind::Float, tch::Device::Cpu))
}

fn assert_send<T: Send>(_: &T) {}

#[test]
fn builds_and_runs() {
    let _s = crate::common::serial();
    memlab::profiler::set_output(memlab::profiler::Output::Sink(Box::new(|_| {})));
    let x = Tensor::ones([2], (Kind::Float, tch::Device::Cpu));
    let mut m = Model::associated();
    m.by_mut(2.0);
    assert_eq!(m.forward(&x).sum(Kind::Float).double_value(&[]), 4.0);
    assert_eq!(m.by_value(), 2.0);
    assert_eq!(generic([1, 2, 3]), vec![1, 2, 3]);
    assert_eq!(returns_impl_trait(3).sum::<usize>(), 6);
    assert_eq!(with_question_mark("21"), Ok(42));
    assert!(with_question_mark("x").is_err());
    assert_eq!(with_lifetimes("a", "b"), "a");
    assert_eq!(unsafe { unsafe_fn(&7) }, 7);
    assert_eq!(c_abi(1), 2);
    let fut = async_fn(1);
    assert_send(&fut);
    drop(fut);
    assert_eq!(diverging_else(None), 0);
    for _ in 0..3 {
        let _ = periodic();
    }
    let report = memlab::report();
    for name in ["Model::by_ref", "<Model as Forward>::forward", "Model::forward", "generic", "unsafe_fn", "c_abi"] {
        let names: Vec<&str> = report.functions.iter().map(|f| f.name.as_str()).collect();
        assert!(report.function(name).is_ok_and(|f| f.ran()), "{name} was profiled: {names:?}");
    }
    assert!(report.function("async_fn").is_ok_and(|f| !f.ran()), "an unpolled future has not run");
    memlab::profiler::set_output(memlab::profiler::Output::Stdout);
}
