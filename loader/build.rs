//! Compiles the gRPC API with protox (a protobuf compiler in Rust), so building needs no
//! `protoc` on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=src/proto");
    let fds = protox::compile(["decode.proto"], ["src/proto"])?;
    tonic_prost_build::configure()
        // `bytes::Bytes` fields: the batch buffer moves into the reply without a copy.
        .bytes(".")
        .compile_fds(fds)?;
    Ok(())
}
