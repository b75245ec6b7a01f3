fn main() {
    println!("stoker-loader");
}
