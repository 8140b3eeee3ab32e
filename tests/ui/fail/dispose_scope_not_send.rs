// A dispose scope belongs to the thread that opened it.
fn needs_send<T: Send>(_: T) {}

fn main() {
    let scope = memlab::DisposeScope::new("step").unwrap();
    needs_send(scope);
}
