fn main() {
    println!("stoker-operator");
}
