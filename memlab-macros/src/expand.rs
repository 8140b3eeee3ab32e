//! Code generation for `#[profile]`: a static site with what is known at
//! compile time, its registration, a frame guard, and a probe before every
//! statement of the body and of the blocks nested in it.

use std::collections::BTreeMap;

use proc_macro2::{Span, TokenStream};
use quote::{quote, ToTokens};
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;
use syn::{Block, Error, ExprAsync, ExprClosure, ExprConst, Ident, Item, ItemFn, Stmt};

use crate::attr::{DeviceArg, Options};

pub fn profile(options: Options, item: TokenStream) -> TokenStream {
    let mut function: ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(_) => {
            let error = Error::new(
                Span::call_site(),
                "#[memlab::profile] goes on a function or method with a body; to profile a trait method, put it on the method of the `impl`",
            );
            return fallback(item, error);
        }
    };
    if let Some(constness) = &function.sig.constness {
        let error = Error::new_spanned(
            constness,
            "#[memlab::profile] cannot profile a `const fn`: it may run at compile time, where there is no allocator. Remove `const`, or profile the function that calls it",
        );
        return fallback(item, error);
    }
    let krate = options.krate.clone().unwrap_or_else(|| syn::parse_quote!(::memlab));
    let frame = Ident::new("__memlab_frame", Span::mixed_site());

    let signature_line = function.sig.fn_token.span.start().line;
    let first_line = match &function.vis {
        syn::Visibility::Inherited => signature_line,
        vis => vis.span().start().line.min(signature_line),
    }
    .max(1);
    let last_line = function.block.brace_token.span.close().start().line.max(first_line);
    let source = source_lines(&function, first_line, last_line);

    let mut instrument = Instrument { frame: &frame };
    instrument.visit_block_mut(&mut function.block);

    let device = match options.device {
        None => quote!(::core::option::Option::None),
        Some(DeviceArg::Auto) => {
            quote!(::core::option::Option::Some(#krate::__private::DeviceSelector::Auto))
        }
        Some(DeviceArg::CurrentCuda) => {
            quote!(::core::option::Option::Some(#krate::__private::DeviceSelector::CurrentCuda))
        }
        Some(DeviceArg::Cpu) => {
            quote!(::core::option::Option::Some(#krate::__private::DeviceSelector::Fixed(
                #krate::__private::Device::Cpu
            )))
        }
        Some(DeviceArg::Cuda(i)) => {
            quote!(::core::option::Option::Some(#krate::__private::DeviceSelector::Fixed(
                #krate::__private::Device::Cuda(#i)
            )))
        }
    };
    let every = options.every;
    let first_line_lit = first_line as u32;
    let signature_line_lit = signature_line as u32;
    let stmts = &function.block.stmts;
    let enter = if function.sig.asyncness.is_some() { quote!(enter_async) } else { quote!(enter) };
    let setup = quote! {
        fn __memlab_here() {}
        static __MEMLAB_FN: #krate::__private::ProfiledFn = #krate::__private::ProfiledFn::new(#krate::__private::ProfiledFnMeta {
            name: || ::core::any::type_name_of_val(&__memlab_here),
            file: ::core::file!(),
            first_line: #first_line_lit,
            signature_line: #signature_line_lit,
            source: &[#(#source),*],
            device: #device,
            every: #every,
        });
        #krate::__private::inventory::submit! { #krate::__private::Registered(&__MEMLAB_FN) }
        let #frame = #krate::__private::#enter(&__MEMLAB_FN);
    };
    // An `async fn` body runs in pieces, one per poll, interleaved with other
    // code on the same thread: its statement must be the thread's only while
    // one of its polls runs.
    let body = if function.sig.asyncness.is_some() {
        quote! {
            {
                #krate::__private::InStatement::new(async move {
                    #setup
                    #(#stmts)*
                })
                .await
            }
        }
    } else {
        quote! {
            {
                #setup
                #(#stmts)*
            }
        }
    };
    function.block = Box::new(syn::parse2(body).expect("generated body parses"));
    function.into_token_stream()
}

/// On error: the user's item unchanged (so rustc's own diagnostics about it
/// stay useful) plus the error.
fn fallback(item: TokenStream, error: Error) -> TokenStream {
    let error = error.to_compile_error();
    quote!(#item #error)
}

/// Inserts `frame.line(N);` before every statement of every block that runs
/// as part of this call. Closures and async blocks may run later or on other
/// threads, `const` blocks run at compile time, and nested items are separate
/// functions: none of them is instrumented.
struct Instrument<'a> {
    frame: &'a Ident,
}

impl VisitMut for Instrument<'_> {
    fn visit_block_mut(&mut self, block: &mut Block) {
        for stmt in &mut block.stmts {
            self.visit_stmt_mut(stmt);
        }
        let frame = self.frame;
        // What a block's locals free when it ends belongs to its closing
        // brace: a guard declared after every other local is dropped first,
        // right after the last statement, and opens the brace's interval.
        let declares_locals = block.stmts.iter().any(|s| matches!(s, Stmt::Local(_) | Stmt::Macro(_)));
        let tail = match block.stmts.last() {
            Some(Stmt::Expr(_, None)) => block.stmts.pop(),
            _ => None,
        };
        // The guard counts the locals' freeing on the closing brace only once
        // the tail has produced the block's value: a `return`, `break` or `?`
        // inside the tail leaves it unarmed, and what the locals free then
        // belongs to that statement. A borrowing tail stays as it is.
        let arm_in_tail = declares_locals && matches!(&tail, Some(Stmt::Expr(e, None)) if !extends_temporaries(e));
        let mut out = Vec::with_capacity(block.stmts.len() * 2 + 3);
        for stmt in block.stmts.drain(..) {
            push_probed(&mut out, frame, stmt);
        }
        if declares_locals {
            out.push(block_end(frame, block, arm_in_tail));
        }
        match tail {
            Some(Stmt::Expr(tail, None)) if arm_in_tail => {
                let span = tail.span();
                let line = span.start().line as u32;
                let end = Ident::new("__memlab_end", Span::mixed_site());
                let value = Ident::new("__memlab_value", Span::mixed_site());
                out.push(syn::parse_quote_spanned!(span=> #frame.line(#line);));
                // A tail that diverges (`return x`, `panic!()`) makes the arm
                // unreachable, which is fine: the guard then stays unarmed.
                out.push(Stmt::Expr(
                    syn::parse_quote!(match (#tail) { #[allow(unreachable_code)] #value => #end.arm(#value) }),
                    None,
                ));
            }
            Some(tail) => push_probed(&mut out, frame, tail),
            None => {}
        }
        block.stmts = out;
    }

    fn visit_expr_closure_mut(&mut self, _: &mut ExprClosure) {}
    fn visit_expr_async_mut(&mut self, _: &mut ExprAsync) {}
    fn visit_expr_const_mut(&mut self, _: &mut ExprConst) {}
    fn visit_item_mut(&mut self, _: &mut Item) {}
}

/// Whether a block's tail is one whose temporaries live as long as the
/// value they are borrowed into (`let s = { ...; &String::new() };`, and
/// the struct, tuple, array and cast expressions around such a borrow): it
/// must stay the block's tail expression, so its guard is armed before it.
fn extends_temporaries(expr: &syn::Expr) -> bool {
    use syn::Expr;
    match expr {
        Expr::Reference(_) => true,
        Expr::Array(a) => a.elems.iter().any(extends_temporaries),
        Expr::Tuple(t) => t.elems.iter().any(extends_temporaries),
        Expr::Struct(s) => s.fields.iter().any(|f| extends_temporaries(&f.expr)),
        Expr::Cast(c) => extends_temporaries(&c.expr),
        Expr::Paren(p) => extends_temporaries(&p.expr),
        Expr::Group(g) => extends_temporaries(&g.expr),
        Expr::Block(b) => matches!(b.block.stmts.last(), Some(Stmt::Expr(e, None)) if extends_temporaries(e)),
        _ => false,
    }
}

/// `let __memlab_end = frame.block_end(LINE);` for the closing brace of
/// `block`; before a tail expression, `frame.block_end_after_tail(LINE)`,
/// which the tail arms (see [`Instrument::visit_block_mut`]).
fn block_end(frame: &Ident, block: &Block, before_tail: bool) -> Stmt {
    let line = block.brace_token.span.close().start().line as u32;
    let end = Ident::new("__memlab_end", Span::mixed_site());
    let make = if before_tail { quote!(block_end_after_tail) } else { quote!(block_end) };
    // After a diverging statement (`return`, `continue`, `panic!`) the guard
    // is unreachable, which is fine: the statement's exit drops the locals.
    syn::parse_quote!(#[allow(unreachable_code)] let #end = #frame.#make(#line);)
}

/// Pushes `stmt`, preceded by `frame.line(N);` unless it is a nested item.
fn push_probed(out: &mut Vec<Stmt>, frame: &Ident, stmt: Stmt) {
    if !matches!(stmt, Stmt::Item(_)) {
        let span = stmt.span();
        let line = span.start().line as u32;
        out.push(syn::parse_quote_spanned!(span=> #frame.line(#line);));
    }
    out.push(stmt);
}

/// The function's source lines, `first..=last`: read from the file being
/// compiled, so the text is exactly what the user wrote. Where the file cannot
/// be read (code generated by another macro), each statement's tokens stand at
/// the line where the statement starts.
fn source_lines(function: &ItemFn, first: usize, last: usize) -> Vec<String> {
    // The file is the right source only if its signature line really declares
    // this function: in doctests, for one, spans count lines from the snippet.
    let signature = format!("fn {}", function.sig.ident);
    let signature_line = function.sig.fn_token.span.start().line;
    let from_file = function
        .sig
        .fn_token
        .span
        .local_file()
        .and_then(|path| std::fs::read_to_string(path).ok())
        .map(|text| text.lines().skip(first - 1).take(last - first + 1).map(str::to_string).collect::<Vec<_>>())
        .filter(|lines| lines.len() == last - first + 1 && lines[signature_line - first].contains(&signature));
    if let Some(lines) = from_file {
        return lines;
    }
    let mut by_line: BTreeMap<usize, String> = BTreeMap::new();
    by_line.insert(function.sig.fn_token.span.start().line, function.sig.to_token_stream().to_string());
    collect_statement_text(&function.block, &mut by_line);
    (first..=last).map(|l| by_line.remove(&l).unwrap_or_default()).collect()
}

fn collect_statement_text(block: &Block, by_line: &mut BTreeMap<usize, String>) {
    struct Collect<'a>(&'a mut BTreeMap<usize, String>);
    impl syn::visit::Visit<'_> for Collect<'_> {
        fn visit_stmt(&mut self, stmt: &Stmt) {
            let text = stmt.to_token_stream().to_string();
            self.0.entry(stmt.span().start().line).or_insert_with(|| text.chars().take(120).collect());
            syn::visit::visit_stmt(self, stmt);
        }
        fn visit_expr_closure(&mut self, _: &ExprClosure) {}
        fn visit_item(&mut self, _: &Item) {}
    }
    syn::visit::Visit::visit_block(&mut Collect(by_line), block);
}
