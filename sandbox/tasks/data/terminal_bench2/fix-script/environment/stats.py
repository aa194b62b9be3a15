import sys


def main(path):
    nums = [float(x) for x in open(path).read().split()]
    mean = sum(nums) // len(nums)
    median = nums[len(nums) // 2]
    print(f"{mean:.2f}")
    print(f"{median:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
