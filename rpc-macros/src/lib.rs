//! `#[remote]`: turns an `async fn` into a remotely callable function of `rpc-core`.
#![deny(missing_docs)]

use proc_macro::TokenStream;
use quote::{format_ident, quote};
use syn::parse::Parser;
use syn::{parse_macro_input, FnArg, ItemFn, LitStr, ReturnType};

/// Turns `async fn name(ctx: CallContext, a: A, b: B) -> Result<T, E>` into a unit type `name`
/// implementing `rpc_core::RemoteFn` with `Args = (A, B)` and `Output = T`, so it can be
/// registered (`Registry::builder().register(name)`) and called
/// (`agent.rpc_async(to, name, (a, b))`).
///
/// The registered name defaults to `module_path!()::name`; override it with
/// `#[remote(name = "stable.name")]`. `E` may be any error convertible into `BoxError`
/// (including `anyhow::Error`).
///
/// Because `name` becomes a unit struct, a local binding of the same name in the same scope
/// (`let echo = ...;` next to `#[remote] async fn echo`) is parsed as a pattern against that
/// struct and fails to compile; pick another local name.
#[proc_macro_attribute]
pub fn remote(attr: TokenStream, item: TokenStream) -> TokenStream {
    let func = parse_macro_input!(item as ItemFn);
    let mut name_override: Option<LitStr> = None;
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("name") {
            name_override = Some(meta.value()?.parse()?);
            Ok(())
        } else {
            Err(meta.error("expected `name = \"...\"`"))
        }
    });
    if let Err(e) = parser.parse(attr) {
        return e.to_compile_error().into();
    }
    match expand(func, name_override) {
        Ok(ts) => ts.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn expand(func: ItemFn, name_override: Option<LitStr>) -> syn::Result<proc_macro2::TokenStream> {
    let sig = &func.sig;
    if sig.asyncness.is_none() {
        return Err(syn::Error::new_spanned(
            sig.fn_token,
            "#[remote] functions must be `async fn`",
        ));
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        return Err(syn::Error::new_spanned(
            &sig.generics,
            "#[remote] functions cannot be generic",
        ));
    }
    let mut inputs = sig.inputs.iter();
    let ctx = match inputs.next() {
        Some(FnArg::Typed(pt)) => pt,
        _ => {
            return Err(syn::Error::new_spanned(
                &sig.inputs,
                "the first parameter of a #[remote] function must be `ctx: CallContext`",
            ))
        }
    };
    let ctx_pat = &ctx.pat;
    let ctx_ty = &ctx.ty;
    let mut pats = Vec::new();
    let mut tys = Vec::new();
    for arg in inputs {
        match arg {
            FnArg::Typed(pt) => {
                pats.push(&pt.pat);
                tys.push(&pt.ty);
            }
            FnArg::Receiver(r) => {
                return Err(syn::Error::new_spanned(
                    r,
                    "#[remote] functions take no `self`",
                ))
            }
        }
    }
    let ret = match &sig.output {
        ReturnType::Type(_, ty) => ty,
        ReturnType::Default => {
            return Err(syn::Error::new_spanned(
                sig,
                "#[remote] functions must return `Result<T, E>` with `E: Into<BoxError>`",
            ))
        }
    };
    let ident = &sig.ident;
    let vis = &func.vis;
    let attrs = &func.attrs;
    let body = &func.block;
    let name = match name_override {
        Some(lit) => quote!(#lit),
        None => {
            let s = ident.to_string();
            quote!(::core::concat!(::core::module_path!(), "::", #s))
        }
    };
    let inner = format_ident!("__remote_body_{}", ident);
    Ok(quote! {
        #(#attrs)*
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, Default)]
        #vis struct #ident;

        impl ::rpc_core::RemoteFn for #ident {
            const NAME: &'static str = #name;
            type Args = (#(#tys,)*);
            type Output = <#ret as ::rpc_core::__private::IntoHandlerResult>::Ok;
            fn call(
                ctx: ::rpc_core::CallContext,
                args: Self::Args,
            ) -> impl ::core::future::Future<
                Output = ::core::result::Result<Self::Output, ::rpc_core::BoxError>,
            > + ::core::marker::Send + 'static {
                #[allow(clippy::too_many_arguments)]
                async fn #inner(#ctx_pat: #ctx_ty, (#(#pats,)*): (#(#tys,)*)) -> #ret #body
                async move {
                    let result = #inner(ctx, args).await;
                    ::rpc_core::__private::IntoHandlerResult::into_handler_result(result)
                }
            }
        }
    })
}
