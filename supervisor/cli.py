def main(argv=None):
    print("spikeguard")
    return 0
